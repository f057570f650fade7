"""The heartbeats' credit cache (``coordinator.credit_cache``): read once, then moved; a read
that raced a change to the same peer's credit is not kept, one that raced another peer's is."""

from __future__ import annotations

from coordinator.credit_cache import CreditCache
from coordinator.store import PeerCredit


class CountingStore:
    def __init__(self) -> None:
        self.reads: list[str] = []
        self.during_read: list[object] = []
        """Called while a read is under way (a change the core commits beside it)."""

    def credit_of(self, key: str) -> PeerCredit:
        self.reads.append(key)
        for change in self.during_read:
            change()  # type: ignore[operator]
        return PeerCredit(samples=10, flops=1.0, pending_samples=0)


def test_a_peer_is_read_once_then_moved() -> None:
    cache, store = CreditCache(), CountingStore()
    assert cache.get("a", store.credit_of).samples == 10
    cache.moved("a", pending=-5, samples=5, flops=2.0)
    credit = cache.get("a", store.credit_of)
    assert (credit.samples, credit.flops, credit.pending_samples) == (15, 3.0, -5)
    assert store.reads == ["a"]


def test_other_peers_changes_do_not_stop_caching() -> None:
    """A swarm of thousands moves some credit every few milliseconds: a read is kept unless
    its own peer's credit changed meanwhile (else nearly every heartbeat reads the database)."""
    cache, store = CreditCache(), CountingStore()
    store.during_read = [lambda: cache.moved("b", pending=64)]
    cache.get("a", store.credit_of)
    store.during_read = []
    cache.get("a", store.credit_of)
    assert store.reads == ["a"]


def test_a_read_that_raced_its_own_peers_change_is_not_kept() -> None:
    cache, store = CreditCache(), CountingStore()
    store.during_read = [lambda: cache.moved("a", pending=64)]
    cache.get("a", store.credit_of)
    store.during_read = []
    cache.get("a", store.credit_of)
    assert store.reads == ["a", "a"]


def test_forget_everyone_drops_reads_under_way() -> None:
    cache, store = CreditCache(), CountingStore()
    cache.get("b", store.credit_of)
    store.during_read = [lambda: cache.forget()]
    cache.get("a", store.credit_of)
    store.during_read = []
    cache.get("a", store.credit_of)
    cache.get("b", store.credit_of)
    assert store.reads == ["b", "a", "a", "b"]


def test_forget_one_peer() -> None:
    cache, store = CreditCache(), CountingStore()
    cache.get("a", store.credit_of)
    cache.get("b", store.credit_of)
    cache.forget("a")
    cache.get("a", store.credit_of)
    cache.get("b", store.credit_of)
    assert store.reads == ["a", "b", "a"]


def test_changed_keys_are_taken_once() -> None:
    cache = CreditCache()
    cache.moved("a", pending=1)
    cache.forget("b")
    assert cache.take_changed() == {"a", "b"}
    assert cache.take_changed() == set()
    cache.forget()
    cache.moved("c", pending=1)
    assert cache.take_changed() is None
    assert cache.take_changed() == set()
