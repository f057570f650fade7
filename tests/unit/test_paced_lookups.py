"""A waiting averager's lookups of its round's declarations are paced (``engine.matchmaking.PacedKeyManager``):
hivemind's search would otherwise spin DHT lookups for a leader's whole window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking

from engine.matchmaking import LOOKUP_INTERVAL_S, PacedKeyManager, round_matchmaking


class _CountingDHT:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def get(self, key: str, latest: bool, return_future: bool) -> Any:
        self.calls.append(time.monotonic())
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)  # nobody declared: hivemind's search would ask again at once
        return future


def test_lookups_are_at_least_the_interval_apart_and_the_first_is_immediate() -> None:
    keys = object.__new__(PacedKeyManager)
    dht = _CountingDHT()
    keys.dht = dht

    async def search() -> float:
        started = time.monotonic()
        for _ in range(4):
            assert await keys.get_averagers("run.0b101", only_active=True) == []
        return started

    started = asyncio.run(search())
    assert len(dht.calls) == 4
    assert dht.calls[0] - started < LOOKUP_INTERVAL_S / 2
    gaps = [later - earlier for earlier, later in zip(dht.calls, dht.calls[1:])]
    assert min(gaps) >= LOOKUP_INTERVAL_S - 1e-3, gaps


def test_the_averagers_matchmaking_gets_the_paced_key_manager() -> None:
    matchmaking = object.__new__(Matchmaking)
    keys = object.__new__(GroupKeyManager)
    matchmaking.__dict__["group_key_manager"] = keys
    round_matchmaking(matchmaking)
    assert type(keys) is PacedKeyManager
