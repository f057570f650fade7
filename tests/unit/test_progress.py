"""The peer's progress display: a live line on a terminal, permanent round lines everywhere."""

from __future__ import annotations

import io
import logging
import os

import pytest

from peer.round.progress import CLEAR_LINE, Credit, InnerProgress, ProgressDisplay, round_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


METRICS = {
    "round": 3,
    "loss": 2.5,
    "samples": 80,
    "wall_s": 2.0,
    "group_size": 3,
    "bytes_sent": 1_500_000,
    "wait_s": 0.25,
    "averaged": True,
    "in_sync": True,
}


def step(n: int, of: int | None = 10, elapsed: float = 1.0, budget: float | None = None) -> InnerProgress:
    return InnerProgress(round=2, step=n, steps=of, elapsed_s=elapsed, budget_s=budget, samples=8 * n, loss=3.0)


def live_text(out: io.StringIO) -> str:
    """What the terminal shows on its current line."""
    return out.getvalue().split("\n")[-1].split(CLEAR_LINE)[-1]


def test_off_a_terminal_only_round_lines_are_written() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out)
    display.inner_step(step(5))
    display.waiting(2)
    display.round_done(METRICS)
    display.clear()
    assert out.getvalue() == round_line(METRICS) + "\n"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_round_line_names_what_a_volunteer_looks_for() -> None:
    line = round_line(METRICS)
    assert "round    3" in line and "loss 2.5000" in line and "40.0 samples/s" in line
    assert "group 3" in line and "sent 1.50 MB" in line
    assert "averaging failed" in round_line({**METRICS, "averaged": False})
    assert "OUT OF SYNC" in round_line({**METRICS, "in_sync": False})


def test_on_a_terminal_the_live_line_shows_the_bar_and_the_swarm() -> None:
    out, clock = Terminal(), Clock()
    display = ProgressDisplay(out, clock=clock, columns=lambda: 200)
    display.inner_step(step(5, elapsed=2.0))
    text = live_text(out)
    assert text.startswith("round    2 [##########..........] 5/10 steps")
    assert "loss 3.0000" in text and "20.0 samples/s" in text and "no group yet" in text and "sent 0.00 MB" in text
    display.round_done(METRICS)
    assert out.getvalue().endswith(CLEAR_LINE + round_line(METRICS) + "\n")
    clock.now += 1
    display.inner_step(step(1))
    assert "last group 3" in live_text(out) and "sent 1.50 MB" in live_text(out)
    display.waiting(3)
    assert live_text(out).startswith("round    3 averaging: looking for a group")


def test_redraws_are_rate_limited_but_the_last_step_always_shows() -> None:
    out, clock = Terminal(), Clock()
    display = ProgressDisplay(out, clock=clock, min_interval_s=0.5, columns=lambda: 200)
    display.inner_step(step(1))
    display.inner_step(step(2))  # same instant: skipped
    assert "1/10 steps" in live_text(out)
    clock.now += 0.6
    display.inner_step(step(3))
    assert "3/10 steps" in live_text(out)
    display.inner_step(step(10))  # the round's last step draws even within the interval
    assert "10/10 steps" in live_text(out) and "[####################]" in live_text(out)


def test_a_time_budget_round_fills_by_time_and_counts_steps() -> None:
    out = Terminal()
    ProgressDisplay(out, columns=lambda: 200).inner_step(step(7, of=None, elapsed=15.0, budget=60.0))
    assert "[#####...............] 15/60 s, 7 steps" in live_text(out)


@pytest.mark.parametrize("columns", [30, 80])
def test_the_live_line_never_wraps(columns: int) -> None:
    out = Terminal()
    ProgressDisplay(out, columns=lambda: columns).inner_step(step(5))
    assert len(live_text(out)) == columns - 1


def test_a_log_record_starts_on_a_clean_line() -> None:
    out = Terminal()
    display = ProgressDisplay(out, columns=lambda: 200)
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        display.guard_logging()
        display.inner_step(step(5))
        logging.getLogger("swarmtrain.test").warning("something happened")
    finally:
        root.removeHandler(handler)
    assert out.getvalue().endswith(CLEAR_LINE + "something happened\n")
    display.clear()  # nothing is showing any more: no second clear
    assert out.getvalue().endswith("something happened\n")


def test_a_closed_or_plain_stream_is_not_a_terminal() -> None:
    closed = open(os.devnull, "w")
    closed.close()
    assert ProgressDisplay(closed).live is False
    assert ProgressDisplay(object()).live is False  # type: ignore[arg-type]


def test_with_a_coordinator_the_live_line_shows_the_credit() -> None:
    out = Terminal()
    credit: list[Credit | None] = [None]
    display = ProgressDisplay(out, columns=lambda: 300, min_interval_s=0, credit=lambda: credit[0])
    display.inner_step(step(1))
    assert "credited" not in live_text(out)  # no answer from the coordinator yet
    credit[0] = Credit(samples=1600, flops=3.2e10, pending_samples=320)
    display.inner_step(step(2))
    assert live_text(out).endswith("| credited 1,600 samples (+320 pending)")
    credit[0] = Credit(samples=1920, flops=3.84e10, pending_samples=0)
    display.waiting(2)
    assert live_text(out).endswith("| credited 1,920 samples")
    assert credit[0].describe() == "credited 1,920 samples (3.84e+10 FLOPs)"
    assert Credit(5, 1e9, 7).describe() == "credited 5 samples (1e+09 FLOPs), 7 pending"


def test_a_round_line_names_the_local_ranks_of_a_node_of_several() -> None:
    assert "local ranks" not in round_line(METRICS)
    assert round_line({**METRICS, "local_world_size": 4}).endswith("| 4 local ranks")
