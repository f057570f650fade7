from __future__ import annotations

import pytest

from peer.round.timeouts import MIN_TIMEOUT_S, AdaptiveTimeouts, matchmaking_windows


def test_deadlines_follow_measurements_within_bounds() -> None:
    t = AdaptiveTimeouts(base_matchmaking_s=20.0, base_allreduce_s=60.0)
    assert (t.matchmaking_s, t.allreduce_s) == (20.0, 60.0)
    for _ in range(20):
        t.observe(matchmaking_s=2.0, allreduce_s=4.0)
    # the spec's matchmaking deadline and a quarter of its all-reduce deadline are the floors
    assert t.matchmaking_s == 20.0 and t.allreduce_s == 15.0
    for _ in range(20):
        t.observe(matchmaking_s=1000.0, allreduce_s=1000.0)
    assert (t.matchmaking_s, t.allreduce_s) == (80.0, 240.0)  # 4 x spec is the ceiling


def test_failures_widen_and_the_floor_holds() -> None:
    t = AdaptiveTimeouts(base_matchmaking_s=4.0, base_allreduce_s=4.0)
    for _ in range(10):
        t.observe(matchmaking_s=0.0, allreduce_s=0.0)
    assert t.allreduce_s == MIN_TIMEOUT_S
    t.failed()
    assert t.allreduce_s == MIN_TIMEOUT_S * 1.5
    for _ in range(10):
        t.failed()
    assert t.allreduce_s == 16.0 and t.matchmaking_s == 16.0


@pytest.mark.parametrize("timeout_s", [0.05, 0.5, 2.0, 3.0, 5.0, 6.0, 15.0, 60.0, 3600.0])
def test_request_timeout_stays_below_the_matchmaking_floor(timeout_s: float) -> None:
    min_matchmaking, request = matchmaking_windows(timeout_s)
    assert min_matchmaking == pytest.approx(timeout_s / 3)
    assert 0 < request < min_matchmaking


def test_usual_timeouts_keep_their_request_timeout() -> None:
    assert matchmaking_windows(15.0) == (5.0, 1.5)
    assert matchmaking_windows(6.0)[1] == 1.0
    assert matchmaking_windows(2.0)[1] == pytest.approx(0.5)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_a_nonpositive_matchmaking_timeout_is_refused(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="matchmaking timeout"):
        matchmaking_windows(timeout_s)
