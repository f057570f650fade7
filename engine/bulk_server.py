"""The reducer's end of the bulk channel (``engine.bulk_channel``): a TLS listener that takes
members' parts over plain TCP and hands them to the averager's own handler
(``rpc_aggregate_part``), as if they had come over a libp2p stream from the same peer.

Who may talk: only a connection whose first frame is the token of a ticket this averager issued
over libp2p (``Tickets``), to the peer the ticket names; each token works once, for
``TICKET_TTL_S``. Everything after that runs under that peer's identity: the handler checks
group membership, decodes and bounds the parts exactly as for a libp2p stream.

An accepted connection becomes its pair's link (``engine.bulk_link``), handed to the pool that
keeps this member's links (``Adopter``, ``engine.bulk_client.BulkPool``): both members' calls go
over it, round after round. The listener's own limits come before anything is spent on a
connection (its TLS handshake included): see ``MAX_PENDING``, ``PENDING_PER_HOST`` and
``PER_PEER``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import resource
import secrets
import socket
import ssl
import time
from typing import Any, Protocol

from hivemind.p2p import PeerID

from engine.bulk_frames import FrameError, Kind, keep_alive, read_frame, write_frame
from engine.bulk_link import BulkLink
from engine.bulk_reader import FrameProtocol, FrameReader

__all__ = ["Adopter", "BulkServer", "Tickets"]

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
TICKET_TTL_S = 60.0
"""How long a ticket's token may wait for its connection: a dial takes a few round trips."""
MAX_TICKETS = 4096
"""Outstanding tickets at most; past that the oldest is forgotten (a member asking in a loop
grows nothing)."""
HELLO_TIMEOUT_S = 10.0
"""From accept to the sender's token (the TLS handshake included)."""
MAX_CONNECTIONS = 4096
"""Connections open at once at most (members' pooled ones, one per sender: 255 in a round of
256, and handshakes in progress), and never more than half the
process's file descriptors (``BulkServer.start`` raises its soft limit); past that new ones are
closed at once, and their senders use libp2p."""
MAX_PENDING = 256
"""Connections not yet past their token at most (their TLS handshake included), and never more
than half of ``MAX_CONNECTIONS``: an outsider who opens connections and says nothing holds
these slots for ``HELLO_TIMEOUT_S`` each, never the members' ones."""
PENDING_PER_HOST = 8
"""Connections not yet past their token from one address at most: one outsider's loop of idle
connections does not hold every slot a new member's handshake needs."""
PER_PEER = 2
"""Connections kept per member (a sender keeps one; its next, after a break, may overlap the
last): a member's new one past this closes its oldest, so one member cannot fill the listener."""
PER_PEER_TICKETS = 8
"""Unredeemed tickets per member (a round asks once per reducer): a member asking in a loop
drops its own oldest, never another's."""


class Adopter(Protocol):
    """Where an accepted link goes (``engine.bulk_client.BulkPool``): it answers the member's
    calls on it and makes this member's calls to that member over it."""

    def adopt(self, peer: PeerID, reader: FrameReader, writer: asyncio.StreamWriter) -> BulkLink: ...


class Tickets:
    """Tokens issued over libp2p, each for one peer, single use, valid ``TICKET_TTL_S``; at most
    ``most`` outstanding and ``per_peer`` per peer (past either, the oldest is forgotten)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, most: int = MAX_TICKETS, per_peer: int = PER_PEER_TICKETS) -> None:
        self.ttl_s, self.most, self.per_peer = ttl_s, most, per_peer
        self._issued: collections.OrderedDict[bytes, tuple[PeerID, float]] = collections.OrderedDict()
        self._by_peer: dict[PeerID, collections.deque[bytes]] = {}

    def issue(self, peer: PeerID) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        self._issued[token] = (peer, time.monotonic() + self.ttl_s)
        mine = self._by_peer.setdefault(peer, collections.deque())
        mine.append(token)
        if len(mine) > self.per_peer:
            self._issued.pop(mine.popleft(), None)
        while len(self._issued) > self.most:
            oldest, (owner, _expires) = self._issued.popitem(last=False)
            self._forget(owner, oldest)
        return token

    def redeem(self, token: bytes) -> PeerID | None:
        """The peer ``token`` was issued to, once; None for a token unknown, used or expired."""
        found = self._issued.pop(token, None)
        if found is None:
            return None
        peer, expires = found
        self._forget(peer, token)
        return peer if time.monotonic() <= expires else None

    def _forget(self, peer: PeerID, token: bytes) -> None:
        mine = self._by_peer.get(peer)
        if mine is not None:
            with contextlib.suppress(ValueError):
                mine.remove(token)
            if not mine:
                del self._by_peer[peer]

    def __len__(self) -> int:
        return len(self._issued)


class BulkServer:
    """Accepts bulk connections and serves their calls with ``handler``."""

    def __init__(self, links: Adopter, context: ssl.SSLContext, tickets: Tickets) -> None:
        self.links, self.context, self.tickets = links, context, tickets
        self.port = 0
        self.refused = 0
        """Connections dropped before or at their token (counted for tests and logs)."""
        self.most = MAX_CONNECTIONS
        self.pending_most = MAX_PENDING
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: set[asyncio.Task[Any]] = set()
        self._pending: collections.Counter[str] = collections.Counter()
        """Connections not yet past their token, per remote address."""
        self._by_peer: dict[PeerID, collections.deque[asyncio.StreamWriter]] = {}

    async def start(self, host: str | None = None, port: int = 0) -> int:
        """Listen on ``host`` (None: every interface) at ``port`` (0: any free one); the port."""
        self.most = min(MAX_CONNECTIONS, _raise_descriptor_limit() // 2)
        self.pending_most = min(MAX_PENDING, self.most // 2)
        self._listener = _listen(host, port)
        self.port = int(self._listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept())
        return self.port

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._open):
            task.cancel()
        if self._open:
            await asyncio.gather(*self._open, return_exceptions=True)

    async def _accept(self) -> None:
        """Each TCP connection is counted against the limits as it is accepted, before anything
        is spent on it: the TLS handshake comes after (``_accepted``)."""
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors, or the like: the listener waits a moment
                logger.warning("bulk listener cannot accept (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            host = str(address[0]) if address else ""
            if (
                len(self._open) >= self.most
                or self._pending.total() >= self.pending_most
                or self._pending[host] >= PENDING_PER_HOST
            ):
                self.refused += 1
                conn.close()
                continue
            self._pending[host] += 1
            task = asyncio.create_task(self._accepted(conn, host))
            self._open.add(task)
            task.add_done_callback(self._open.discard)

    async def _accepted(self, conn: socket.socket, host: str) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            peer, reader, writer = await self._hello(conn, host)
            if peer is not None and writer is not None:
                await self._serve(reader, writer, peer)
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            FrameError,
            TimeoutError,
            ssl.SSLError,
        ) as exc:
            logger.debug("bulk connection dropped: %s: %s", type(exc).__name__, exc)
        except asyncio.CancelledError:  # the listener stops (``stop``): the connection goes quietly
            pass
        finally:
            if writer is None:
                conn.close()
            else:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _hello(
        self, conn: socket.socket, host: str
    ) -> tuple[PeerID | None, FrameReader, asyncio.StreamWriter | None]:
        """The TLS handshake and the sender's token, ``HELLO_TIMEOUT_S`` in all: the peer its
        ticket names (None: refused), and the connection's two ends."""
        loop = asyncio.get_running_loop()
        protocol = FrameProtocol(first=TOKEN_BYTES)  # nothing larger than a token before it is in
        reader = protocol.reader
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn, ssl=self.context)
                writer = asyncio.StreamWriter(transport, protocol, None, loop)
                keep_alive(writer)
                kind, _call, token = await read_frame(reader, limit=TOKEN_BYTES)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError, TimeoutError, ssl.SSLError) as exc:
            self.refused += 1
            logger.info("bulk connection refused: no token (%s)", type(exc).__name__)
            return None, reader, writer
        finally:
            self._pending[host] -= 1
            if self._pending[host] <= 0:
                del self._pending[host]
        peer = self.tickets.redeem(bytes(token)) if kind == Kind.HELLO else None
        if peer is None:
            self.refused += 1
            logger.info("bulk connection refused: its token is not one this peer issued, or was used or expired")
        return peer, reader, writer

    async def _serve(self, reader: FrameReader, writer: asyncio.StreamWriter, peer: PeerID) -> None:
        mine = self._by_peer.setdefault(peer, collections.deque())
        mine.append(writer)
        while len(mine) > PER_PEER:  # this member's oldest connection makes room
            mine.popleft().transport.abort()
        try:
            write_frame(writer, Kind.HELLO)
            await writer.drain()
            await self.links.adopt(peer, reader, writer).closed()
        finally:
            with contextlib.suppress(ValueError):
                mine.remove(writer)
            if not mine and self._by_peer.get(peer) is mine:
                del self._by_peer[peer]


def _listen(host: str | None, port: int) -> socket.socket:
    """A non-blocking listening socket at ``host`` (None: every interface, IPv6 too where the
    machine has it) and ``port``."""
    backlog = 1024
    if host is None and socket.has_dualstack_ipv6():
        try:
            listener = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog)
        except OSError:  # IPv6 off in this namespace
            listener = socket.create_server(("0.0.0.0", port), backlog=backlog)
    else:
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        listener = socket.create_server((host or "0.0.0.0", port), family=family, backlog=backlog)
    listener.setblocking(False)
    return listener


def _raise_descriptor_limit(wanted: int = 2 * MAX_CONNECTIONS + 1024) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (up to the hard limit);
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.debug("could not raise the open-file limit from %d", soft)
    return int(soft if soft != resource.RLIM_INFINITY else wanted)
