"""A waiting averager's lookups of its round's declarations are paced (``engine.matchmaking.PacedKeyManager``):
hivemind's search would otherwise spin DHT lookups for a leader's whole window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking

from engine.matchmaking import FIRST_LOOKUP_PAUSE_S, LOOKUP_PAUSE_MAX_S, PacedKeyManager, round_matchmaking


class _CountingDHT:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def get(self, key: str, latest: bool, return_future: bool) -> Any:
        self.calls.append(time.monotonic())
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)  # nobody declared: hivemind's search would ask again at once
        return future


def test_lookups_of_one_key_back_off_and_a_new_key_starts_over() -> None:
    keys = object.__new__(PacedKeyManager)
    dht = _CountingDHT()
    keys.dht = dht

    async def search() -> float:
        started = time.monotonic()
        for _ in range(7):
            assert await keys.get_averagers("run.0b101", only_active=True) == []
        for _ in range(2):
            assert await keys.get_averagers("run.0b110", only_active=True) == []
        return started

    started = asyncio.run(search())
    assert len(dht.calls) == 9
    assert dht.calls[0] - started < FIRST_LOOKUP_PAUSE_S  # the first look is at once
    gaps = [later - earlier for earlier, later in zip(dht.calls, dht.calls[1:])]
    pauses = [min(LOOKUP_PAUSE_MAX_S, FIRST_LOOKUP_PAUSE_S * 2**i) for i in range(6)]  # 0.05 ... the cap
    assert all(gap >= pause - 1e-3 for gap, pause in zip(gaps[:6], pauses)), gaps
    assert gaps[5] < LOOKUP_PAUSE_MAX_S + 0.5  # capped
    assert gaps[6] < FIRST_LOOKUP_PAUSE_S  # the next round's key: at once
    assert FIRST_LOOKUP_PAUSE_S - 1e-3 <= gaps[7] < LOOKUP_PAUSE_MAX_S


def test_the_averagers_matchmaking_gets_the_paced_key_manager() -> None:
    matchmaking = object.__new__(Matchmaking)
    keys = object.__new__(GroupKeyManager)
    matchmaking.__dict__["group_key_manager"] = keys
    round_matchmaking(matchmaking)
    assert type(keys) is PacedKeyManager
