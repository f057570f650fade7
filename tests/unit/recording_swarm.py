"""An in-memory swarm a trainer runs against in the unit tests (``RecordingSwarm``: it records what
the trainer launched and answers each round with ``next_result``), and the tiny spec it sizes
its vector by."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.round.swarm_port import LentOutbox, RoundResult
from protocol.gathered import Gathered
from protocol.modelsize import count_params
from protocol.roster import RosterClaim
from protocol.spec import parse_spec
from tests.specs import bare_spec

SPEC = bare_spec("unit", d_model=16, context=8, batch_size=2, inner_steps=2, compression="int8", overlap=False)


@dataclass
class _Pending:
    result_value: RoundResult | None
    meets: int = 0

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def abandon(self) -> bool:
        return False

    def result(self) -> RoundResult | None:
        return self.result_value


@dataclass
class RecordingSwarm:
    """Records what the trainer hands to the swarm; every round 'fails' unless told otherwise."""

    launched: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    published: list[dict[str, Any]] = field(default_factory=list)
    next_result: RoundResult | None = None
    others: set[str] = field(default_factory=lambda: {"ed25519:other"})
    """Peers the DHT shows at the trainer's round."""
    claim: RosterClaim = RosterClaim(0, frozenset())
    """What the holders of any state published about its roster."""
    beside: frozenset[str] = frozenset()
    """Who outside the trainer's group the DHT shows landed its round already."""

    def __post_init__(self) -> None:
        self.averager: Any = None
        self.provider: Any = None
        self.matchmaking_timeouts: list[float] = []
        self.windows: list[float] = []
        self.joinings: list[bool] = []
        """Each launch's ``joining`` (a newcomer's search waits longer for a leader's answer)."""
        self.newcomer = False
        self.fence_checks: list[tuple[int, frozenset[str]]] = []
        self.kept: list[tuple[int, str, str, list[tuple[int, int]]]] = []
        # the averager's shared vector; NaN until the trainer writes its round into it
        self.vector = torch.full((count_params(parse_spec(SPEC).task.model),), float("nan"))

    @contextmanager
    def outbox(self) -> Iterator[torch.Tensor]:
        yield self.vector

    def lend_outbox(self) -> LentOutbox | None:
        """The vector, for the inner steps' gradients (``peer.round.grad_home``)."""
        return LentOutbox(self.vector, lambda: None)

    def serve_state(self, provider: Any) -> None:
        self.provider = provider

    def download_state(self, accept: set[str], *, timeout: float, newer_than: int | None = None) -> Any:
        return self.averager.load_verified_state(accept, timeout) if self.averager is not None else None

    def keep_update(self, round_: int, pre: str, post: str, left_out: list[tuple[int, int]]) -> None:
        self.kept.append((round_, pre, post, left_out))

    def download_update(self, round_: int, digest: str, *, timeout: float) -> Any:
        return None

    def start_round(
        self, *, weight: float, gather: Gathered, timeout: float, window: float = 0.0, joining: bool = False
    ) -> _Pending:
        self.launched.append((self.vector.clone(), weight))
        self.matchmaking_timeouts.append(timeout)
        self.windows.append(window)
        self.joinings.append(joining)
        return _Pending(self.next_result)

    def accepted_state(self, **kwargs: Any) -> None:
        return None

    def publish_digest(self, *args: Any, **kwargs: Any) -> None:
        self.published.append(kwargs)

    def roster_of(self, digest: str, **kwargs: Any) -> RosterClaim:
        return self.claim

    def behind(self, round_: int) -> bool:
        return self.newcomer

    def saw_group(self, members: list[Gathered]) -> None:
        self.seen = [m.id for m in members]

    def peers_at(self, round_: int, **kwargs: Any) -> set[str]:
        return set(self.others)

    def landed_beside(self, round_: int, group: frozenset[str], *, within_s: float) -> frozenset[str]:
        self.fence_checks.append((round_, group))
        return self.beside

    def lookup_s(self) -> float:
        return 0.0

    def prefetch_records(self) -> None:
        pass

    def seen_at(self, round_: int) -> float | None:
        return None

    def set_allreduce_timeout(self, timeout_s: float) -> None:
        self.allreduce_timeout = timeout_s
