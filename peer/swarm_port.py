"""What the trainer needs from the swarm: the small typed interface ``peer.swarm.Swarm``
implements (and the unit tests' in-memory swarm), so that the training loop never reaches
into hivemind's DHT or averager."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from protocol.agreement import Agreement
from protocol.identity import Identity, PublicKey
from protocol.roster import RosterClaim

StateProvider = Callable[[], tuple[int, torch.Tensor, torch.Tensor, str]]
"""Returns the (round, params, momentum, digest) this peer serves to others."""
DownloadedState = tuple[int, torch.Tensor, torch.Tensor]
"""(round, params, momentum) of a state downloaded from a member, digest verified."""


class PendingAverage(Protocol):
    """An averaging round started in the background."""

    def done(self) -> bool: ...

    def result(self) -> Any:
        """Block until the round ends: a ``peer.swarm.RoundResult``, or None if it failed."""
        ...


class SwarmPort(Protocol):
    def outbox(self) -> AbstractContextManager[torch.Tensor]:
        """The flat float32 vector the next round averages, to write this peer's (compensated)
        pseudo-gradient into in place; after a successful round it holds the group's average
        (``RoundResult.averaged`` is this vector, valid until the next write)."""
        ...

    def start_round(
        self, *, weight: float, gather: dict[str, Any], timeout: float | None = None, window: float | None = None
    ) -> PendingAverage:
        """Average the outbox's vector with whoever is looking within ``timeout`` s; this peer
        declares it would lead a group for ``window`` s (default ``matchmaking_window(timeout)``)."""
        ...

    def set_allreduce_timeout(self, timeout_s: float) -> None: ...

    def saw_group(self, members: list[dict[str, Any]]) -> None: ...

    def publish_digest(self, identity: Identity, *, round_: int, digest: str, roster: int = 0) -> None: ...

    def roster_of(self, digest: str, *, exclude: PublicKey | None = None) -> RosterClaim: ...

    def behind(self, round_: int) -> bool: ...

    def accepted_state(self, *, exclude: PublicKey | None = None) -> Agreement | None: ...

    def fallback_states(self, *, exclude: PublicKey | None = None, after_round: int = -1) -> list[Agreement]: ...

    def peers_at(self, round_: int, *, exclude: PublicKey | None = None) -> set[str]: ...

    def serve_state(self, provider: StateProvider) -> None: ...

    def download_state(self, accept: set[str], *, timeout: float) -> DownloadedState | None: ...
