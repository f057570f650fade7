"""Keeping a peer's DHT node joined to the whole swarm after an outage.

hivemind's DHT drops a node from its routing table the moment a request to it goes unanswered
(``DHTProtocol.update_routing_table``), and learns nodes only from requests and lookups. While
the coordinator (the bootstrap node everybody knows) is down, or a link is, each peer's lookups
time out against the nodes it cannot reach and it forgets them; once they are back nobody
re-introduces the two sides, and the swarm lives on as two DHTs that never see each other's
records or round declarations. The churn lab measured it: after a 38 s coordinator outage the
datacenter and rented peers and the home peers kept separate routing tables, each side landed
its own round 18 and from there its own timeline (``benchmarks/results/churn-lab-2026-11-28.md``).

``keep_bootstrapped`` runs in the DHT's process (``DHT.run_coroutine``) for the node's life:
every ``CHECK_S`` it looks whether each bootstrap peer is in its routing table, and when one is
not (it was dropped), or ``MEND_EVERY_S`` passed since the last mend, it dials the bootstrap
peers again at their known addresses, pings them (which puts this node in their tables and
them in its own) and looks up its own id through them (a Kademlia bootstrap's last step:
the nodes they know nearest to it, whichever side of the outage they were on, enter its
table). In steady state it costs a dictionary look-up every ``CHECK_S``; the periodic mend is
one ping and one lookup per peer every ``MEND_EVERY_S`` (spread by jitter), which a bootstrap
node serving thousands of peers takes in its stride.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

__all__ = ["CHECK_S", "MEND_EVERY_S", "bootstrap_peers", "keep_bootstrapped"]

CHECK_S = 5.0
"""How often the node looks for its bootstrap peers in its routing table."""
MEND_EVERY_S = 300.0
"""A node mends at least this often (±25%) even when its bootstrap peers are in its table: a
bootstrap node that restarted under the same peer id is in the table but knows nobody."""


def bootstrap_peers(maddrs: list[str]) -> dict[PeerID, list[Multiaddr]]:
    """The bootstrap peers' ids and addresses (``/.../p2p/<id>`` multiaddrs); others are skipped."""
    peers: dict[PeerID, list[Multiaddr]] = {}
    for text in maddrs:
        try:
            maddr = Multiaddr(text)
            peer = PeerID.from_base58(maddr["p2p"])
        except Exception:  # noqa: BLE001 - not a dialable peer address: nothing to mend with
            logger.debug("dht mend: %r names no peer id; not used", text)
            continue
        peers.setdefault(peer, []).append(maddr)
    return peers


async def keep_bootstrapped(
    maddrs: list[str], _dht: Any, node: Any, *, check_s: float = CHECK_S, mend_every_s: float = MEND_EVERY_S
) -> None:
    """Run in the DHT's process for the node's life (see the module's text)."""
    peers = bootstrap_peers(maddrs)
    if not peers:
        return
    loop = asyncio.get_running_loop()
    mend_at = loop.time() + mend_every_s * random.uniform(0.75, 1.25)
    while node.is_alive:
        await asyncio.sleep(check_s)
        table = node.protocol.routing_table
        missing = [peer for peer in peers if peer not in table]
        if not missing and loop.time() < mend_at:
            continue
        mend_at = loop.time() + mend_every_s * random.uniform(0.75, 1.25)
        try:
            await _mend(node, peers, missing)
        except Exception as exc:  # noqa: BLE001 - the bootstrap peers may still be down: next check
            logger.debug("dht mend failed: %s", exc)


async def _mend(node: Any, peers: dict[PeerID, list[Multiaddr]], missing: list[PeerID]) -> None:
    """Dial and ping the bootstrap peers, then look up this node's own id through them."""
    answered = 0
    for peer, addresses in peers.items():
        try:
            # hivemind's P2P has no public dial: the daemon client's connect re-learns the address
            await node.p2p._client.connect(peer, addresses)
        except Exception as exc:  # noqa: BLE001 - unreachable now: the ping says so too
            logger.debug("dht mend: could not dial %s: %s", peer, exc)
        if await node.protocol.call_ping(peer) is not None:
            answered += 1
    if not answered:
        return
    before = len(node.protocol.routing_table.uid_to_peer_id)
    await node.find_nearest_nodes([node.node_id])
    after = len(node.protocol.routing_table.uid_to_peer_id)
    if missing:
        logger.info(
            "dht: %d bootstrap peer(s) had dropped out of this node's routing table; rejoined through them"
            " (%d nodes known, %d before)",
            len(missing),
            after,
            before,
        )
