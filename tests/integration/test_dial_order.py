"""Two members of a round that share no libp2p connection yet, each about to send the other its
parts (``engine.dial_order``), over two real p2p daemons on loopback.

Dialling each other at the same moment, as a round's first parts do, the dials can fail ("failed
to negotiate security protocol": p2pd dials from its listening port, so the two can meet as one
TCP simultaneous open with both ends the security handshake's initiator; libp2p's dial backoff
then refuses the next dials). Here that happened to 1 pair in 10 on loopback (``_client.connect``
from both ends at once), in most first rounds on 40 ms links (``benchmarks.wan_averaging``). Made
by one end of each pair, every pair connects and no dial fails."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from engine.dial_order import open_round_connections

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _pair() -> tuple[P2P, P2P]:
    first = await P2P.create(host_maddrs=LOOPBACK)
    second = await P2P.create(host_maddrs=LOOPBACK)
    return first, second


async def _know_each_other(a: P2P, b: P2P) -> None:
    """The daemons learn each other's addresses (one connection's identify exchange, as a DHT
    call would teach them), then drop the connection."""
    addresses = [Multiaddr(str(m).split("/p2p/")[0]) for m in await b.get_visible_maddrs()]
    await a._client.connect(b.peer_id, addresses)
    await asyncio.sleep(0.5)  # identify runs on the new connection
    await a._client.disconnect(b.peer_id)
    for _ in range(200):
        if b.peer_id not in {i.peer_id for i in await a.list_peers()} and a.peer_id not in {
            i.peer_id for i in await b.list_peers()
        }:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the first connection did not close")


PAIRS = 8


def test_two_members_who_each_send_to_the_other_connect_with_one_dial(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        for _ in range(PAIRS):
            await one_pair()

    async def one_pair() -> None:
        a, b = await _pair()
        try:
            await _know_each_other(a, b)
            members = [a.peer_id, b.peer_id]
            dials: list[object] = []
            for daemon in (a, b):
                connect = daemon._client.connect

                async def counted(peer: object, maddrs: object, connect: Any = connect) -> None:
                    dials.append(peer)
                    await connect(peer, maddrs)

                daemon._client.connect = counted
            with caplog.at_level(logging.INFO, logger="engine.dial_order"):
                missing = await asyncio.wait_for(
                    asyncio.gather(
                        open_round_connections(a, a.peer_id, members, i_reduce=True),
                        open_round_connections(b, b.peer_id, members, i_reduce=True),
                    ),
                    30,
                )
            assert missing == [[], []]
            assert b.peer_id in {info.peer_id for info in await a.list_peers()}
            assert a.peer_id in {info.peer_id for info in await b.list_peers()}
            assert len(dials) == 1, "both ends dialled"  # the one that sorts first; the other waited
            assert "failed" not in caplog.text
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(main())
