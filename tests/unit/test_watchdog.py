"""The peer's watchdog (``peer.round.watchdog``): failed rounds in a row are said on one line with the
last reason (again every few more), never silently; the peer leaves cleanly only when told to
(``--leave-after-failures``) or when the host runs out of memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.round.round_metrics import RoundMetrics
from peer.round.watchdog import REMIND_EVERY, WARN_AFTER, Watchdog, available_memory_fraction


def _round(n: int, averaged: bool, failure: str = "") -> RoundMetrics:
    return RoundMetrics(
        round=n,
        group_size=2 if averaged else 1,
        samples=8,
        loss=1.0,
        state_digest="",
        bytes_sent=0,
        bytes_received=0,
        compute_s=0.1,
        wait_s=0.1,
        wall_s=0.2,
        in_sync=True,
        averaged=averaged,
        params=10,
        allreduce_s=0.0,
        matchmaking_timeout_s=1.0,
        allreduce_timeout_s=1.0,
        failure=failure,
    )


def _dog(**kwargs: object) -> tuple[Watchdog, list[str], list[str]]:
    said: list[str] = []
    left: list[str] = []
    dog = Watchdog(say=said.append, leave=left.append, memory=lambda: 0.5, **kwargs)  # type: ignore[arg-type]
    return dog, said, left


def test_failed_rounds_are_said_with_their_reason_and_again_every_few() -> None:
    dog, said, left = _dog()
    for n in range(WARN_AFTER + REMIND_EVERY):
        dog.on_round(_round(n, False, "no group formed"))
    assert len(said) == 2 and all("rounds in a row failed (last: no group formed)" in line for line in said)
    assert said[0].startswith(f"{WARN_AFTER} rounds") and said[1].startswith(f"{WARN_AFTER + REMIND_EVERY} rounds")
    dog.on_round(_round(99, True))
    assert said[-1] == f"averaging again after {WARN_AFTER + REMIND_EVERY} failed rounds"
    assert not left and not dog.reason  # failing rounds alone never make it leave by default


def test_a_few_failures_say_nothing() -> None:
    dog, said, _ = _dog()
    for n in range(WARN_AFTER - 1):
        dog.on_round(_round(n, False))
    dog.on_round(_round(9, True))
    assert said == []


def test_with_leave_after_it_leaves_once_saying_why() -> None:
    dog, _, left = _dog(leave_after=5)
    for n in range(8):
        dog.on_round(_round(n, False, "a reducer failed"))
    assert len(left) == 1 and "5 rounds in a row failed (last: a reducer failed); leaving" in left[0]
    assert dog.reason == left[0]


def test_it_leaves_before_the_host_runs_out_of_memory() -> None:
    left: list[str] = []
    dog = Watchdog(say=lambda line: None, leave=left.append, memory=lambda: 0.01)
    dog.on_round(_round(4, True))
    assert len(left) == 1 and "1.0% of its memory left after round 4" in left[0]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Watchdog(say=print, leave=print, warn_after=0)
    with pytest.raises(ValueError):
        Watchdog(say=print, leave=print, leave_after=-1)


def test_the_hosts_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    assert available_memory_fraction(meminfo) == 0.25
    meminfo.write_text("garbage\n")
    assert available_memory_fraction(meminfo) is None
    assert available_memory_fraction(tmp_path / "absent") is None
    assert available_memory_fraction() is None or 0 < available_memory_fraction() <= 1  # this host
