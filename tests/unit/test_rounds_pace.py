"""The swarm's pace in status (``coordinator.snapshot.rounds_per_hour``): rounds finalized lately,
at their pace; none lately, 0 (a restarted coordinator with no peer said 4293.5 rounds/h)."""

from __future__ import annotations

import pytest

from coordinator.snapshot import MIN_PACE_SPAN_S, PACE_WINDOW_S, rounds_per_hour
from coordinator.store.rows import RoundRow


def row(round_: int, at: float) -> RoundRow:
    return RoundRow(round=round_, state_digest="d", finalized_at=at, group_size=2, mean_loss=None, samples=1,
                    validation_loss=None)  # fmt: skip


def test_a_steady_swarm_shows_its_pace() -> None:
    rounds = [row(r, 1000.0 + 10 * r) for r in range(60, -1, -1)]  # a round every 10 s, newest first
    assert rounds_per_hour(rounds, now=1600.0) == pytest.approx(360.0, rel=0.05)


def test_an_idle_or_restarted_swarm_shows_no_pace_it_does_not_have() -> None:
    old = [row(r, 1000.0 + 0.01 * r) for r in range(100, -1, -1)]  # decided in a burst, long ago
    assert rounds_per_hour(old, now=1000.0 + PACE_WINDOW_S + 5) == 0.0
    burst = [row(r, 5000.0 + 0.01 * r) for r in range(5, -1, -1)]  # just decided in a burst
    assert rounds_per_hour(burst, now=5001.0) == pytest.approx(6 * 3600.0 / MIN_PACE_SPAN_S)
    assert rounds_per_hour([], now=1.0) == 0.0
