"""Which end of a pair dials a round's libp2p connection (``engine.dial_order``): exactly one of
every pair that sends both ways, never a member that nobody dials; the other end's dial where
this one's fails (libp2p's backoff), and bounded waits."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

from hivemind.p2p import PeerID

from engine.dial_order import dialled_by_them, open_round_connections


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
    """A p2p daemon's view: ``connected`` as ``list_peers`` gives it; ``connect`` dials, and fails
    (as p2pd's dial backoff does) towards the peers in ``backoff``."""

    def __init__(self, backoff: set[PeerID] | None = None) -> None:
        self.connected: set[PeerID] = set()
        self.backoff = backoff or set()
        self.dialled: list[PeerID] = []
        self.listed = 0
        self._client = self

    async def list_peers(self) -> list[SimpleNamespace]:
        self.listed += 1
        return [SimpleNamespace(peer_id=peer) for peer in self.connected]

    async def connect(self, peer: PeerID, _maddrs: list[object]) -> None:
        self.dialled.append(peer)
        await asyncio.sleep(0.01)
        if peer in self.backoff:
            raise ConnectionError(f"failed to dial {peer}: dial backoff")
        self.connected.add(peer)


def _sorted_pair() -> tuple[PeerID, PeerID]:
    low, high = sorted(_peers(2), key=lambda peer: peer.to_bytes())
    return low, high


def test_the_first_in_order_dials_and_the_other_waits_for_it() -> None:
    async def scenario() -> None:
        low, high = _sorted_pair()
        p2p_low, p2p_high = _P2P(), _P2P()
        # the low end's dial reaches the high end: both daemons see the connection
        dialled = asyncio.Event()

        async def connect_low(peer: PeerID, _maddrs: list[object]) -> None:
            p2p_low.connected.add(peer)
            p2p_high.connected.add(low)
            dialled.set()

        p2p_low._client = SimpleNamespace(connect=connect_low)  # type: ignore[assignment]
        high_side = asyncio.ensure_future(open_round_connections(p2p_high, high, [low, high], i_reduce=True))
        await asyncio.sleep(0.2)
        assert not high_side.done() and p2p_high.dialled == []  # waiting, not dialling
        assert await open_round_connections(p2p_low, low, [low, high], i_reduce=True) == []
        assert await asyncio.wait_for(high_side, 2.0) == []
        assert p2p_high.dialled == []  # one dial for the pair, by the low end

    asyncio.run(scenario())


def test_a_dial_refused_by_backoff_waits_for_the_other_ends_dial() -> None:
    async def scenario() -> None:
        low, high = _sorted_pair()
        p2p = _P2P(backoff={high})
        asyncio.get_running_loop().call_later(0.3, p2p.connected.add, high)  # the high end's own dial
        assert await open_round_connections(p2p, low, [high], i_reduce=True, wait_s=1.0) == []
        assert p2p.dialled == [high]

    asyncio.run(scenario())


def test_a_wait_that_ends_empty_dials_and_a_peer_never_reached_is_named() -> None:
    async def scenario() -> None:
        low, high = _sorted_pair()
        p2p = _P2P()
        started = time.monotonic()
        assert await open_round_connections(p2p, high, [low], i_reduce=True, wait_s=0.3) == []
        assert p2p.dialled == [low] and time.monotonic() - started >= 0.3  # waited, then dialled
        stuck = _P2P(backoff={low})
        assert await open_round_connections(stuck, high, [low], i_reduce=True, wait_s=0.2) == [low]

    asyncio.run(scenario())


def test_a_member_that_does_not_reduce_dials_at_once_and_never_waits() -> None:
    async def scenario() -> None:
        low, high = _sorted_pair()
        p2p = _P2P(backoff={low})
        started = time.monotonic()
        assert await open_round_connections(p2p, high, [low], i_reduce=False, wait_s=5.0) == [low]
        assert time.monotonic() - started < 1.0

    asyncio.run(scenario())


def test_kept_connections_cost_one_call() -> None:
    async def scenario() -> None:
        p2p, peers = _P2P(), _peers(3)
        p2p.connected.update(peers)
        assert await open_round_connections(p2p, peers[0], peers, i_reduce=True) == []
        assert p2p.listed == 1 and p2p.dialled == []

    asyncio.run(scenario())


def test_a_daemon_that_cannot_list_its_connections_never_fails_the_round() -> None:
    """The parts then dial as they did before this step: every reducer is named, nothing raises."""

    class Broken(_P2P):
        async def list_peers(self) -> list[SimpleNamespace]:
            raise ConnectionError("p2pd control socket closed")

    async def scenario() -> None:
        low, high = _sorted_pair()
        assert await open_round_connections(Broken(), high, [low, high], i_reduce=True) == [low]

    asyncio.run(scenario())
