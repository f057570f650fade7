"""The bulk channel: the all-reduce's parts over long-lived TLS connections beside libp2p.

hivemind's libp2p streams carry 78-84% of what plain TCP carries on links of 40-120 ms round
trip (less as the round trip grows; ``benchmarks/wan_averaging.py``): each stream goes through
the p2p daemon's socket and its multiplexer's window. Parts are the only bulk bytes of a round,
so they take a TCP connection of their own between sender and reducer, with the kernel's window
and nothing between, kept from round to round.

No weaker than libp2p: an outsider can neither send a part nor read one.

- The dialler asks the other member over libp2p (``rpc_bulk_ticket``; libp2p authenticates both
  ends to their identities) for a ticket: the port it listens on, the SHA-256 of its TLS
  certificate (a throwaway one, ``engine.bulk_tls``) and a fresh token. A member gives tickets
  only to peers the run admits (``engine.averager_gate``).
- The dialler dials that member's address of its libp2p connection (a direct one only) at that
  port, accepts only the pinned certificate (so it talks to that member, encrypted), and sends
  the token: the acceptor then knows which peer this is (``engine.bulk_server``). Tokens work
  once. So each end knows the other, and either may make calls on the link.
- Every part then goes to the averager's own handler, as over libp2p: membership, decoding,
  bounds, bans and audits are the same code.

Where there is no direct path (a relayed peer, a firewall, a peer without a listener, an old
version that has no ``rpc_bulk_ticket``) the sender uses the libp2p stream as before
(``engine.bulk_client``). Mixed into ``engine.averager.ExactAverager``.

On by default (``--bulk-port 0``, any free port; ``off``: libp2p only; ``engine.bulk_settings``):
on 4 simulated hosts it reaches 96-98% of plain TCP where libp2p reaches 92-96% (docs/benchmarks.md).

One connection per pair of members carries every fragment's calls both ways (``engine.bulk_link``,
``engine.bulk_frames``), as libp2p's one connection per pair does, so a member's uplink carries
one flow per other member and a small router buffer sees one opening burst per pair. Of two
members that both reduce, the one whose ID sorts first dials and the other waits for that link
(``engine.bulk_client``). A round makes its libp2p connections first, one end of each pair
dialling (``engine.dial_order``), then asks for its tickets over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_client import DIAL_S, BulkPool, Ticket, direct_hosts
from engine.bulk_server import TOKEN_BYTES, BulkServer, Tickets
from engine.bulk_settings import BulkSettings
from engine.bulk_tls import make_server_cert
from engine.dial_order import dialled_by_them, open_round_connections

__all__ = ["BulkChannelMixin", "parse_ticket"]

logger = logging.getLogger(__name__)

PIN_BYTES = 32


def parse_ticket(answer: averaging_pb2.AveragingData, serializer: Any) -> Ticket | None:
    """A reducer's ticket (untrusted bytes), or None for a refusal or anything malformed."""
    if answer.code != averaging_pb2.NO_CODE or not answer.peer_id:
        return None
    try:
        port, pin, token = serializer.loads(answer.peer_id)
    except Exception:  # noqa: BLE001 - not a ticket
        return None
    if not (isinstance(port, int) and 0 <= port <= 65535):
        return None
    if not (
        isinstance(pin, bytes) and len(pin) == PIN_BYTES and isinstance(token, bytes) and len(token) == TOKEN_BYTES
    ):
        return None
    return Ticket(port, pin, token)


class BulkChannelMixin:
    """The averager's listener, its tickets, and its pool of connections to reducers."""

    bulk: BulkSettings
    client_mode: bool
    peer_id: PeerID
    prefix: str
    serializer: Any
    _p2p: Any

    async def add_p2p_handlers(
        self, p2p: Any, wrapper: Any = None, *, namespace: str | None = None, balanced: bool = False
    ) -> None:
        """hivemind's, and the bulk listener beside them (in the averager's process, once)."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)  # type: ignore[misc]
        if self.bulk.enabled and not self.client_mode and self.__dict__.get("_bulk_server") is None:
            cert = make_server_cert()
            self._bulk_tickets = Tickets()
            pool = self.bulk_pool()
            assert pool is not None
            server = BulkServer(pool, cert.context, self._bulk_tickets)
            try:
                await server.start(self.bulk.host, self.bulk.port)
            except OSError as exc:
                logger.warning("bulk channel not listening (%s): parts come over libp2p", exc)
                return
            self._bulk_pin = cert.pin
            self._bulk_server = server
            logger.debug("bulk channel listening on port %d", server.port)

    async def remove_p2p_handlers(self, p2p: Any, *, namespace: str | None = None) -> None:
        server: BulkServer | None = self.__dict__.pop("_bulk_server", None)
        if server is not None:
            await server.stop()
        pool: BulkPool | None = self.__dict__.pop("_bulk_pool_", None)
        if pool is not None:
            pool.close()
        await super().remove_p2p_handlers(p2p, namespace=namespace)  # type: ignore[misc]

    async def rpc_bulk_ticket(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A ticket for the caller (``[port, pin, token]`` in ``peer_id``), if the run admits it
        and this peer listens; an empty answer otherwise."""
        server: BulkServer | None = self.__dict__.get("_bulk_server")
        if server is None:
            return averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE)
        if not await self._admitted(context.remote_id):  # type: ignore[attr-defined]  # engine.averager_gate
            logger.warning("refused a bulk ticket to %s: not admitted to this run", context.remote_id)
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        token = self._bulk_tickets.issue(context.remote_id)
        port = self.bulk.public_port or server.port
        return averaging_pb2.AveragingData(peer_id=self.serializer.dumps([port, self._bulk_pin, token]))

    def bulk_pool(self) -> BulkPool | None:
        """This averager's connections to reducers (in its process; None with the channel off)."""
        if not self.bulk.enabled:
            return None
        pool: BulkPool | None = self.__dict__.get("_bulk_pool_")
        if pool is None:
            handler = self.rpc_aggregate_part  # type: ignore[attr-defined]  # hivemind's DecentralizedAverager
            pool = BulkPool(self._bulk_ticket, self._direct_hosts, handler=handler, local_id=self.peer_id)
            self.__dict__["_bulk_pool_"] = pool
        return pool

    async def open_paths(self, members: Sequence[PeerID], fractions: Sequence[float] | None) -> None:
        """Before a round's parts flow, its paths to its reducers (the other ``members`` whose
        share of ``fractions`` is not 0; all of them without fractions). First their libp2p
        connections, made by one end of each pair (``engine.dial_order``: two members dialling
        each other at once can both fail); then, with the channel on, the pairs' bulk links: kept
        ones cost nothing, new ones are dialled (``QUICK_S`` at most) while the links are still
        quiet (under the round's first bursts a slow link's small buffer drops their handshakes),
        by this member or, where the other member sorts first and this one reduces too (it has
        parts to send here), by that one, which this one waits for."""
        shares = fractions if fractions is not None else [1.0] * len(members)
        reducers = [peer for peer, share in zip(members, shares) if share > 0 and peer != self.peer_id]
        i_reduce = any(share > 0 for peer, share in zip(members, shares) if peer == self.peer_id)
        if reducers:
            await open_round_connections(self._p2p, self.peer_id, reducers, i_reduce=i_reduce)
        pool = self.bulk_pool()
        if pool is not None and reducers:
            listening = self.__dict__.get("_bulk_server") is not None
            theirs = set(dialled_by_them(self.peer_id, reducers, i_reduce=i_reduce)) if listening else set()
            opens = (pool.open(peer, theirs=peer in theirs) for peer in reducers)
            await asyncio.gather(*opens, return_exceptions=True)

    async def _bulk_ticket(self, peer: PeerID) -> Ticket | None:
        stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)  # type: ignore[attr-defined]
        answer = await stub.rpc_bulk_ticket(averaging_pb2.AveragingData(), timeout=DIAL_S)
        return parse_ticket(answer, self.serializer)

    async def _direct_hosts(self, peer: PeerID) -> list[str]:
        for info in await self._p2p.list_peers():
            if info.peer_id == peer:
                return direct_hosts(info.addrs)
        return []
