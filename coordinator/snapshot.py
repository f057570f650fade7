"""One picture of the swarm at an instant (``Coordinator.snapshot``): what the gRPC status, the
HTTP status and ``/metrics`` all show, read from the core once per request under its lock."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.health import PeerHealth
from coordinator.round_view import RoundFigures
from coordinator.store import RoundRow

__all__ = ["DataProgress", "SwarmSnapshot", "rounds_per_hour"]


@dataclass(frozen=True)
class DataProgress:
    """Token runs: how far the run is through its data."""

    tokens_trained: int
    """Granted samples x the sequence length."""
    epoch: float
    """The data order's position, in epochs, as granted reporters stated it."""
    slots: int
    """The run's data streams."""
    slots_held: int
    """Streams held by live peers."""


@dataclass(frozen=True)
class SwarmSnapshot:
    """The swarm as the coordinator sees it at ``at``."""

    at: float
    run_name: str
    spec_digest: str
    latest: RoundRow | None
    """The newest finalized round."""
    evaluated: RoundRow | None
    """The newest round with a validation loss."""
    peers_online: int
    samples_per_second: float
    rounds_per_hour: float
    """Over the newest finalized rounds (0 with fewer than two)."""
    data: DataProgress | None
    rounds: list[RoundFigures]
    """How the newest reported rounds averaged, highest first (``coordinator.round_view``)."""
    peers: list[PeerHealth]
    """Every known peer, by key."""

    @property
    def current_round(self) -> int:
        return self.latest.round if self.latest is not None else 0

    @property
    def current_state_digest(self) -> str:
        return self.latest.state_digest if self.latest is not None else ""


def rounds_per_hour(rounds: list[RoundRow]) -> float:
    """The pace of ``rounds`` (newest first) between the first and the last one finalized."""
    if len(rounds) < 2:
        return 0.0
    span = rounds[0].finalized_at - rounds[-1].finalized_at
    return 3600.0 * (len(rounds) - 1) / span if span > 0 else 0.0
