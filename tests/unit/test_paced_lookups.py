"""A waiting averager's lookups of its round's declarations are paced (``engine.matchmaking.PacedKeyManager``):
hivemind's search would otherwise spin DHT lookups for a leader's whole window; and it goes on looking for
as long as it searches (``engine.matchmaking.RoundPotentialLeaders``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from engine.matchmaking import (
    FIRST_LOOKUP_PAUSE_S,
    LOOKUP_PAUSE_MAX_S,
    PacedKeyManager,
    RoundPotentialLeaders,
    round_matchmaking,
)


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


class _Declarations:
    """A round's declarations as the DHT shows them: ``late`` appears from the ``appear_after``-th lookup on."""

    current_key = "run.0b10"

    def __init__(self, early: list[tuple[PeerID, float]], late: tuple[PeerID, float], appear_after: int) -> None:
        self.early, self.late, self.appear_after, self.lookups = early, late, appear_after, 0

    async def get_averagers(self, group_key: str, only_active: bool) -> list[tuple[PeerID, float]]:
        self.lookups += 1
        await asyncio.sleep(0.01)
        return self.early + ([self.late] if self.lookups > self.appear_after else [])


def _leader_asked(search: type[PotentialLeaders]) -> tuple[PeerID, float]:
    """The leader a peer leading a follower asks first, when a peer declares after them both
    with the earliest expiration of the three; and the search's ``max_assured_time`` then."""
    me, follower, late = PeerID(b"\x00me"), PeerID(b"\x00follower"), PeerID(b"\x00late")

    async def ask() -> tuple[PeerID, float]:
        now = get_dht_time()
        leaders = search(me, min_matchmaking_time=2.0, target_group_size=None)
        leaders.declared_expiration_time = now + 8.0  # this peer's window
        leaders.search_end_time = now + 10.0  # its deadline
        # its follower declared a longer window, past this peer's deadline; the late peer a short one
        keys = _Declarations([(follower, now + 11.0)], (late, now + 5.0), appear_after=3)
        leaders.running.set()
        updates = asyncio.create_task(leaders._update_queue_periodically(keys))
        try:
            leader = await asyncio.wait_for(leaders.pop_next_leader(), timeout=2.0)
            return leader, leaders.max_assured_time
        finally:
            updates.cancel()

    return asyncio.run(ask())


def test_a_peer_declared_later_with_an_earlier_expiration_is_asked_to_lead() -> None:
    """Peers declare windows of their own length (their adaptive timeouts), so one that launches
    late may expire first: the others go on looking and ask it, even when every peer they
    already know would lead only after their own search ends. The search marks that it has read
    the declarations as hivemind's does (``RoundMatchmaking._first_in_line`` waits for the mark:
    without it no leader closes on a complete roster, and every round waits out its window)."""
    leader, assured = _leader_asked(RoundPotentialLeaders)
    assert leader == PeerID(b"\x00late")
    assert assured > get_dht_time()  # the late peer's expiration, less the clocks' allowed discrepancy


def test_hivemind_alone_stops_looking_there() -> None:
    """The case above with hivemind's own search: it never asks the late peer, which fails its
    round alone (why ``RoundPotentialLeaders`` exists; if hivemind changes this, it can go)."""
    with pytest.raises(asyncio.TimeoutError):
        _leader_asked(PotentialLeaders)


def test_the_averagers_search_is_the_rounds() -> None:
    matchmaking = object.__new__(Matchmaking)
    matchmaking.__dict__["potential_leaders"] = PotentialLeaders(PeerID(b"\x00me"), 2.0, None)
    round_matchmaking(matchmaking)
    assert type(matchmaking.potential_leaders) is RoundPotentialLeaders


class _SlowStoreDHT:
    """A DHT whose stores wait for a replica that answers late (a home link, a replica gone)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.stored: list[tuple[Any, Any, bool]] = []

    def store(self, key: Any, subkey: Any, value: bool, expiration_time: float, return_future: bool) -> Any:
        async def slow() -> bool:
            await asyncio.sleep(self.delay_s)
            self.stored.append((key, subkey, value))
            return True

        return asyncio.ensure_future(slow())


def test_a_search_that_ends_withdraws_its_declaration_without_waiting_for_the_store() -> None:
    """hivemind withdraws a declaration under its one-search lock: a store that waits for a slow
    replica held up the next round's search (a search given up, ``Landing.abandon_if_landed``,
    lost its peer the next round too). The withdrawal is stored in the background; a
    declaration is still awaited."""
    keys = object.__new__(PacedKeyManager)
    dht = _SlowStoreDHT(delay_s=0.5)
    keys.dht = dht
    peer = PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))

    async def search() -> tuple[float, float]:
        started = time.monotonic()
        assert await keys.declare_averager("run.0b1", peer, get_dht_time() + 5, looking_for_group=True)
        declared = time.monotonic() - started
        started = time.monotonic()
        assert await keys.declare_averager("run.0b1", peer, get_dht_time() + 5, looking_for_group=False)
        withdrawn = time.monotonic() - started
        await asyncio.sleep(0.8)  # the withdrawal is stored meanwhile
        return declared, withdrawn

    declared, withdrawn = asyncio.run(search())
    assert declared >= 0.5 and withdrawn < 0.1
    assert [value for _key, _subkey, value in dht.stored] == [True, False]


def test_a_leader_that_turned_this_peer_away_is_asked_once_more_in_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind asks each leader once per search (``past_attempts``). A request turned away for
    waiting behind the leader's lock then left its sender no leader: it failed its round alone,
    and the leader's group waited out its window for it. One more ask, after the next read of
    the declarations; a leader that turns it away twice is not asked again."""
    matchmaking = object.__new__(Matchmaking)
    leaders = PotentialLeaders(PeerID(b"\x00me"), 2.0, None)
    matchmaking.__dict__["potential_leaders"] = leaders
    round_matchmaking(matchmaking)
    matchmaking.__dict__["step_control"] = step = object()
    leader = PeerID(b"\x00leader")

    async def turned_away(self: Any, asked: PeerID) -> None:
        return None

    monkeypatch.setattr(Matchmaking, "_request_join_group", turned_away)
    leaders.past_attempts.update({(leader, 5.0), (PeerID(b"\x00other"), 6.0)})
    assert asyncio.run(matchmaking._request_join_group(leader)) is None
    assert leaders.past_attempts == {(PeerID(b"\x00other"), 6.0)}  # the leader may be asked again
    leaders.past_attempts.add((leader, 5.0))
    asyncio.run(matchmaking._request_join_group(leader))
    assert (leader, 5.0) in leaders.past_attempts  # twice: not again
    matchmaking.__dict__["step_control"] = object()  # the next round's search
    asyncio.run(matchmaking._request_join_group(leader))
    assert (leader, 5.0) not in leaders.past_attempts
    assert step is not matchmaking.step_control
