"""One picture of the swarm at an instant (``Coordinator.snapshot``): what the gRPC status, the
HTTP status and ``/metrics`` all show, read from the core once per request under its lock."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.health import PeerHealth
from coordinator.progress import RunProgress
from coordinator.round_view import RoundFigures
from coordinator.store import RoundRow
from protocol.spec import RunSpec

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
    progress: RunProgress | None = None
    """How far the run is, and its ETA (``coordinator.progress``)."""

    @property
    def current_round(self) -> int:
        return self.latest.round if self.latest is not None else 0

    @property
    def current_state_digest(self) -> str:
        return self.latest.state_digest if self.latest is not None else ""


PACE_WINDOW_S = 600.0
"""The pace counts the rounds finalized in the last this many seconds."""
MIN_PACE_SPAN_S = 60.0
"""...over at least this long: rounds finalized in a burst (a restarted coordinator deciding the
reports peers kept for it) are not a pace of a round a second."""


def rounds_per_hour(rounds: list[RoundRow], now: float) -> float:
    """The swarm's pace at ``now``: rounds finalized in the last ``PACE_WINDOW_S`` per hour, over
    the time since the first of them (at least ``MIN_PACE_SPAN_S``); 0 once none was lately. Was
    the span between the newest and oldest stored rounds, whatever their age: a coordinator
    restarted with no peer said 4293.5 rounds/h."""
    recent = [r for r in rounds if now - PACE_WINDOW_S <= r.finalized_at <= now]
    if not recent:
        return 0.0
    span = max(now - min(r.finalized_at for r in recent), MIN_PACE_SPAN_S)
    return 3600.0 * len({r.round for r in recent}) / span


def data_progress(spec: RunSpec, granted: int, *, epoch: float, slots_held: int) -> DataProgress:
    """A token run's way through its data: tokens trained (the ``granted`` samples x sequence
    length), the data order's position in epochs (as reported), its streams and those held."""
    return DataProgress(
        tokens_trained=granted * (spec.sequence_length() or 0),
        epoch=epoch,
        slots=spec.data.slots,
        slots_held=slots_held,
    )
