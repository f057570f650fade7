"""``coordinator.slots``: a token run's data streams, one live peer each, kept across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.slots import DataSlots
from coordinator.store import Store, sqlite_url
from protocol.errors import AdmissionError


def test_streams_are_handed_out_once_kept_by_key_and_freed_by_the_lease(tmp_path: Path) -> None:
    with Store(sqlite_url(tmp_path)) as store:
        slots = DataSlots(store, 4, now=0.0, lease_s=100.0)
        assert slots.assign("a", 1, now=0.0) == 0
        assert slots.assign("node", 2, now=0.0) == 1  # a node of two ranks: two consecutive streams
        assert slots.held_by("node") == [1, 2]
        assert slots.assign("a", 1, now=10.0) == 0  # a rejoin keeps its stream
        assert slots.assign("b", 1, now=10.0) == 3
        with pytest.raises(AdmissionError, match="all 4 data streams of this run are held by live peers"):
            slots.assign("c", 1, now=50.0)
        slots.seen("a", 150.0)
        slots.seen("b", 150.0)
        # "node" was last seen at 0: after the lease the newcomer takes one of its streams, and
        # the node loses both (never half a node training beside another peer)
        assert slots.assign("c", 1, now=150.0) == 1
        assert slots.held_by("node") == []
        assert slots.holders() == {"a", "b", "c"}
        assert store.data_slots() == {0: "a", 1: "c", 3: "b"}
        # a restarted coordinator hands out the same streams: every holder counts as just seen
        restarted = DataSlots(store, 4, now=200.0, lease_s=100.0)
        assert restarted.assign("a", 1, now=200.0) == 0
        assert restarted.assign("c", 1, now=200.0) == 1
        with pytest.raises(AdmissionError):
            restarted.assign("d", 2, now=200.0)  # 2 is free, but 3 ("b") is within its lease
        assert restarted.assign("d", 1, now=200.0) == 2


def test_a_peer_that_leaves_frees_its_streams_at_once(tmp_path: Path) -> None:
    with Store(sqlite_url(tmp_path)) as store:
        slots = DataSlots(store, 2, now=0.0, lease_s=100.0)
        assert slots.assign("a", 1, now=0.0) == 0
        assert slots.assign("b", 1, now=0.0) == 1
        slots.release("a")  # a leaving heartbeat: no lease to wait out
        assert slots.held_by("a") == []
        assert store.data_slots() == {1: "b"}  # and a restarted coordinator knows it
        assert DataSlots(store, 2, now=5.0, lease_s=100.0).assign("c", 1, now=5.0) == 0
