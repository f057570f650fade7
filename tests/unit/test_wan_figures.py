"""The WAN benchmark's figures from metrics rows."""

from __future__ import annotations

import math

import pytest

from benchmarks.wan_figures import figures, link_bound_s, markdown_table


def row(round_: int, *, compute: float, wall: float, sent: int, allreduce: float, loss: float) -> dict:
    return {
        "round": round_,
        "compute_s": compute,
        "wall_s": wall,
        "samples": 80,
        "bytes_sent": sent,
        "allreduce_s": allreduce,
        "loss": loss,
        "averaged": True,
        "params": 1_000_000,
    }


def test_link_bound_is_the_bandwidth_optimal_all_reduce() -> None:
    # 4 peers, 1M fp32 values, 20 Mbit/s: 2*3/4 * 4 MB * 8 / 20e6 = 2.4 s
    assert link_bound_s(peers=4, params=1_000_000, codec="none", link_bps=20e6) == pytest.approx(2.4)
    assert link_bound_s(peers=4, params=1_000_000, codec="int8", link_bps=20e6) == pytest.approx(2.4 * 1.0625 / 4)
    assert link_bound_s(peers=1, params=1_000_000, codec="none", link_bps=20e6) == 0.0


def test_figures_skip_start_up_and_compare_with_the_bound() -> None:
    peer = [row(0, compute=1.0, wall=9.0, sent=6_000_000, allreduce=8.0, loss=5.0)] + [
        row(i, compute=1.0, wall=1.25, sent=6_000_000, allreduce=3.0, loss=4.0 - i / 10) for i in range(1, 5)
    ]
    result = figures("fp32", [peer, peer], codec="none", link_bps=20e6)
    assert result.rounds == 5
    assert result.utilization == pytest.approx(0.8)
    assert result.samples_per_s == pytest.approx(2 * 4 * 80 / 5.0)
    assert result.allreduce_s == 3.0
    assert result.link_bound_s == pytest.approx(2 * 1 / 2 * 4e6 * 8 / 20e6)
    assert result.link_efficiency == pytest.approx(result.link_bound_s / 3.0)
    assert result.final_loss == pytest.approx(3.6)
    table = markdown_table([result], reference="fp32")
    assert result.utilization_per_peer == pytest.approx((0.8, 0.8))
    assert "| fp32 | 80.0% (80.0%) | 80.0% |" in table and "+0.00%" in table


def test_no_rounds_is_an_error_and_no_averaging_has_no_efficiency() -> None:
    with pytest.raises(ValueError, match="no rounds"):
        figures("x", [[], []], codec="none", link_bps=1e6)
    lonely = [dict(row(0, compute=1, wall=2, sent=0, allreduce=0, loss=3), averaged=False)] * 3
    assert math.isnan(figures("x", [lonely], codec="none", link_bps=1e6).link_efficiency)


def test_bytes_measured_on_the_link_replace_the_rows() -> None:
    peer = [dict(row(i, compute=1.0, wall=2.0, sent=0, allreduce=0.0, loss=3.0)) for i in range(4)]
    result = figures("hivemind", [peer, peer], codec="none", link_bps=20e6, link_bytes=[8_000_000, 4_000_000])
    assert result.bytes_per_peer_round == pytest.approx((2e6 + 1e6) / 2)
    assert result.bytes_per_sample == pytest.approx(12e6 / (2 * 4 * 80))
    assert math.isnan(result.allreduce_s) and "| - |" in markdown_table([result])


def test_overlapped_rounds_count_the_training_threads_time_once() -> None:
    # overlap: each round's result lands 4 s into the next round's 10 s of inner steps, so
    # wall_s (first inner step to result) is 14 s, but the thread never waited
    peer = [
        dict(row(i, compute=10.0, wall=14.0, sent=1, allreduce=2.0, loss=3.0), wait_s=0.0, host_s=0.1) for i in range(5)
    ]
    peer[-1] = dict(peer[-1], wait_s=4.0)  # the last round has nothing to overlap with
    result = figures("fp32", [peer], codec="none", link_bps=20e6)
    assert result.utilization == pytest.approx(40.0 / (40.4 + 4.0))
    assert result.steady_utilization == pytest.approx(30.0 / 30.3)
