from __future__ import annotations

import math

from peer.round.inner import InnerPhase
from swarmtrain.commands.demo import summarize


def row(round_: int, digest: str, loss: float, averaged: bool = True, in_sync: bool = True) -> dict:
    return {
        "round": round_,
        "state_digest": digest,
        "loss": loss,
        "averaged": averaged,
        "in_sync": in_sync,
        "samples": 8,
        "bytes_sent": 10,
    }


def test_rounds_are_compared_by_number_and_a_resynced_peer_is_fine() -> None:
    histories = [
        [row(1, "a", 5.0), row(2, "b", 4.0), row(3, "c", 3.0)],
        [row(1, "a", 5.0), row(3, "c", 3.1)],  # failed round 2, then re-synced
    ]
    summary = summarize(histories, [0, 0])
    assert summary["ok"] and summary["rounds"] == 3 and summary["digests_agree"]


def test_disagreeing_digests_or_a_failed_peer_fail_the_demo() -> None:
    assert not summarize([[row(1, "a", 5.0)], [row(1, "b", 4.0)]], [0, 0])["ok"]
    assert not summarize([[row(1, "a", 5.0), row(2, "b", 4.0)]], [1])["ok"]
    assert not summarize([[row(1, "a", 4.0), row(2, "b", 5.0)]], [0])["ok"]  # loss went up


def test_a_row_its_peer_flagged_out_of_sync_is_counted_apart() -> None:
    histories = [
        [row(1, "a", 5.0), row(2, "b", 4.0)],
        [row(1, "a", 5.0), row(2, "x", 4.1, in_sync=False)],
    ]
    summary = summarize(histories, [0, 0])
    assert summary["ok"] and summary["out_of_sync_rows"] == 1


def test_a_round_joined_with_no_steps_measured_no_loss_and_is_left_out_of_the_loss() -> None:
    """A late joiner's first row has no steps: its loss is NaN (a 0.0 there once read as a
    loss of zero and made the first loss of a run look lower than any trained one)."""
    joined = row(1, "a", float("nan")) | {"samples": 0}
    histories = [[row(1, "a", 5.0), row(2, "b", 4.0)], [joined, row(2, "b", 4.2)]]
    summary = summarize(histories, [0, 0])
    assert summary["ok"] and summary["loss_first"] == (5.0 + 4.2) / 2 and summary["loss_last"] == (4.0 + 4.2) / 2


def test_an_inner_phase_without_steps_has_no_loss() -> None:
    assert math.isnan(InnerPhase(0.0, 0.0, 0, 0, 0).loss)
    assert InnerPhase(0.0, 0.0, 2, 0, 0, done=2, loss_sum=3.0).loss == 1.5
