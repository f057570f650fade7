"""Which end of a pair dials a round's libp2p connection (``engine.dial_order``): exactly one of
every pair that sends both ways, never a member that nobody dials, and a bounded wait."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

from hivemind.p2p import PeerID

from engine.dial_order import await_dials, dialled_by_them


def _peers(n: int) -> list[PeerID]:
    return [PeerID(bytes([7, 200 - i]) + b"member") for i in range(n)]


def test_of_every_pair_of_reducers_exactly_one_waits_for_the_other() -> None:
    members = _peers(6)
    waits = {me: set(dialled_by_them(me, members, i_reduce=True)) for me in members}
    for a, b in itertools.combinations(members, 2):
        assert (b in waits[a]) != (a in waits[b]), f"{a} and {b}: both wait or both dial"
    assert all(me not in waiting for me, waiting in waits.items())


def test_a_member_that_does_not_reduce_waits_for_nobody() -> None:
    """Nobody sends it parts, so nobody dials it: it dials every reducer itself."""
    members = _peers(4)
    last = max(members, key=lambda peer: peer.to_bytes())
    assert dialled_by_them(last, members, i_reduce=False) == []
    assert len(dialled_by_them(last, members, i_reduce=True)) == 3


class _P2P:
    """``list_peers`` over a set that a test fills as connections arrive."""

    def __init__(self) -> None:
        self.connected: set[PeerID] = set()
        self.calls = 0

    async def list_peers(self) -> list[SimpleNamespace]:
        self.calls += 1
        return [SimpleNamespace(peer_id=peer) for peer in self.connected]


def test_the_wait_ends_when_the_connections_arrive() -> None:
    async def scenario() -> None:
        p2p, (a, b) = _P2P(), _peers(2)
        asyncio.get_running_loop().call_later(0.2, p2p.connected.update, {a, b})
        started = time.monotonic()
        assert await await_dials(p2p, [a, b], wait_s=5.0) == []
        assert 0.15 <= time.monotonic() - started < 2.0

    asyncio.run(scenario())


def test_a_connection_that_never_comes_is_given_up_and_named() -> None:
    async def scenario() -> None:
        p2p, (a, b) = _P2P(), _peers(2)
        p2p.connected.add(a)
        started = time.monotonic()
        assert await await_dials(p2p, [a, b], wait_s=0.3) == [b]
        assert 0.3 <= time.monotonic() - started < 2.0

    asyncio.run(scenario())


def test_kept_connections_cost_one_call() -> None:
    async def scenario() -> None:
        p2p, peers = _P2P(), _peers(3)
        p2p.connected.update(peers)
        assert await await_dials(p2p, peers) == []
        assert p2p.calls == 1

    asyncio.run(scenario())
