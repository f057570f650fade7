"""What the coordinator's core and its heartbeat processes (``coordinator.front``) send each other
over their pipes. Both ends are this project's own processes (a parent and the children it
spawned), so the records travel pickled.

Core → front: ``Answers`` (the answer each admitted key's heartbeat gets, and the keys no longer
admitted), ``STOP``. Front → core: ``READY``/``FAILED`` once at start, ``Beats`` (verified
heartbeats, in batches), ``Acked`` (an ``Answers`` applied)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVICE = "swarmtrain.v1.Coordinator"
"""The gRPC service's full name (``protocol/coordinator.proto``)."""
NOT_ADMITTED = "not admitted (coordinator restarted, or banned): join again"
"""A heartbeat's answer to a key the coordinator does not count as admitted."""

READY = "ready"
FAILED = "failed"
STOP = "stop"


@dataclass(frozen=True)
class Answer:
    """What an admitted peer's heartbeat is answered with (``credit`` None: left out, the
    database could not be read)."""

    credit: tuple[int, float, int] | None
    """Samples granted, their FLOPs, samples claimed and not decided yet."""
    data_slot: int | None = None

    def fill(self, response: Any) -> None:
        """Set these figures on a ``HeartbeatResponse``."""
        if self.credit is not None:
            response.credited_samples, response.credited_flops, response.pending_samples = self.credit
        if self.data_slot is not None:
            response.data_slot = self.data_slot


@dataclass(frozen=True)
class Answers:
    """Answers to set (new or changed) and keys to drop; acknowledged with ``Acked(seq)``."""

    seq: int
    answers: dict[str, Answer]
    dropped: tuple[str, ...] = ()


@dataclass(frozen=True)
class Acked:
    seq: int


@dataclass(frozen=True)
class Beat:
    """A heartbeat a front verified (signature, freshness, bounds, admitted by its table, not a
    replay there): what the core needs to apply it and to check the replay across fronts."""

    key: str
    signer: bytes
    """The raw public key."""
    nonce: bytes
    timestamp: float
    body: bytes
    """The serialized ``HeartbeatBody``."""
    received_at: float


@dataclass(frozen=True)
class Beats:
    beats: tuple[Beat, ...]
