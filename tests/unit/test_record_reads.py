"""How a peer reads the digest records (``peer.swarm.swarm.Swarm.records``): a read serves the calls of
the next ``RECORDS_FRESH_S``, and one begun by ``prefetch_records`` (beside an update download,
so that both take one lookup's time on a home link) serves the next call unless it is old."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest

import peer.swarm.swarm as swarm_module
from peer.swarm.swarm import PREFETCH_FRESH_S, Swarm
from peer.swarm.swarm_pace import LandingTimes, SwarmPace
from protocol.statesync import DigestRecord


class Records:
    """``RunRecords`` as the reads see it: counts the lookups begun and waited for."""

    def __init__(self) -> None:
        self.begun = 0
        self.waited = 0

    def start_digest_records(self) -> Callable[[], list[DigestRecord]]:
        self.begun += 1

        def finish() -> list[DigestRecord]:
            self.waited += 1
            return []

        return finish


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(swarm_module.time, "monotonic", fake.monotonic)
    return fake


def reader() -> tuple[Swarm, Records]:
    swarm = Swarm.__new__(Swarm)  # the reads alone: no DHT, no averager
    records = Records()
    swarm.run_records = records  # type: ignore[assignment]
    swarm.gate = None
    swarm.electorate = set()
    swarm._records = (-math.inf, [])
    swarm._reading = None
    swarm._reads = threading.Lock()
    swarm._lookup_s = 0.0
    swarm._pace = SwarmPace()
    swarm._landed = LandingTimes()
    return swarm, records


def test_a_read_serves_the_next_second(clock: Clock) -> None:
    swarm, records = reader()
    swarm.records()
    clock.now += 0.5
    swarm.records()
    assert records.begun == 1
    clock.now += 0.6
    swarm.records()
    assert records.begun == 2


def test_a_prefetched_read_is_taken_by_the_next_call_and_begun_once(clock: Clock) -> None:
    swarm, records = reader()
    swarm.prefetch_records()
    swarm.prefetch_records()  # one under way: not begun again
    assert (records.begun, records.waited) == (1, 0)
    clock.now += 2.0  # an update download beside it
    swarm.records()
    assert (records.begun, records.waited) == (1, 1)
    assert swarm.lookup_s() == 0.0  # the time it waited beside a download is not a lookup's


def test_an_old_prefetched_read_is_dropped_and_the_records_read_again(clock: Clock) -> None:
    swarm, records = reader()
    swarm.prefetch_records()
    clock.now += PREFETCH_FRESH_S
    swarm.records()
    assert (records.begun, records.waited) == (2, 1)  # the old one never waited for


def test_a_prefetched_read_is_as_fresh_as_when_it_began(clock: Clock) -> None:
    """It shows the DHT as it was when it began: it serves the calls of a second from then,
    not from when it was taken."""
    swarm, records = reader()
    swarm.prefetch_records()
    clock.now += 0.9
    swarm.records()
    clock.now += 0.2  # 1.1 s after it began
    swarm.records()
    assert records.begun == 2
