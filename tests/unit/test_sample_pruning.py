"""The coordinator's tick keeps the swarm_samples table bounded: samples older than the
longest history window go, at most every PRUNE_EVERY_S; recent ones stay. Time is passed in."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.core import HISTORY_KEEP_S, PRUNE_EVERY_S, Coordinator
from coordinator.store import Store, sqlite_url
from protocol.identity import Identity
from protocol.spec import parse_spec

SPEC = '[run]\nname = "prune"\n'


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened = Store(sqlite_url(tmp_path))
    yield opened
    opened.close()


def coordinator(store: Store, **kwargs: float) -> Coordinator:
    return Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[], **kwargs
    )


def times(store: Store) -> list[float]:
    return [s.at for s in store.samples(since=float("-inf"))]


def test_the_default_keeps_the_longest_history_window() -> None:
    assert HISTORY_KEEP_S >= 24 * 3600.0
    assert PRUNE_EVERY_S <= 600.0


def test_tick_deletes_samples_older_than_the_window_and_keeps_recent_ones(store: Store) -> None:
    keep = 1000.0
    now = 100_000.0
    for at in (now - 5000.0, now - keep - 1.0, now - keep, now - 10.0):
        store.record_sample(now=at, peers_online=1, samples_per_second=1.0)
    core = coordinator(store, history_keep_s=keep)
    core.tick(now=now)
    assert times(store) == [now - keep, now - 10.0, now]  # exactly keep s old stays, this tick's own too


def test_tick_prunes_at_most_every_prune_period(store: Store) -> None:
    keep = 100.0
    core = coordinator(store, history_keep_s=keep)
    start = 10_000.0
    core.tick(now=start)  # first tick prunes (nothing to prune yet)
    store.record_sample(now=start - 2 * keep, peers_online=0, samples_per_second=0.0)  # stale
    core.tick(now=start + 1.0)
    core.tick(now=start + PRUNE_EVERY_S - 1.0)
    assert start - 2 * keep in times(store), "pruned again before PRUNE_EVERY_S passed"
    core.tick(now=start + PRUNE_EVERY_S)
    assert start - 2 * keep not in times(store)
    # the first two ticks' samples are now older than keep too; the last two stay
    assert times(store) == [start + PRUNE_EVERY_S - 1.0, start + PRUNE_EVERY_S]


def test_tick_calls_prune_samples_with_the_window_edge(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    monkeypatch.setattr(store, "prune_samples", lambda before: calls.append(before) or 0)
    core = coordinator(store)
    core.tick(now=50_000.0)
    core.tick(now=50_001.0)
    core.tick(now=50_000.0 + PRUNE_EVERY_S)
    assert calls == [50_000.0 - HISTORY_KEEP_S, 50_000.0 + PRUNE_EVERY_S - HISTORY_KEEP_S]
