"""The reducer's end of the bulk channel (``engine.bulk_channel``): a TLS listener that takes
members' parts over plain TCP and hands them to the averager's own handler
(``rpc_aggregate_part``), as if they had come over a libp2p stream from the same peer.

Who may talk: only a connection whose first frame is the token of a ticket this averager issued
over libp2p (``Tickets``), to the peer the ticket names; each token works once, for
``TICKET_TTL_S``. Everything after that runs under that peer's identity: the handler checks
group membership, decodes and bounds the parts exactly as for a libp2p stream.

One connection per sender carries all its calls at once (one per fragment), and round after
round (the sender keeps it): a call is the sender's ``DATA`` frames and ``END``, the averaged
parts back and this side's ``END``; the sender's ``CLOSE`` ends it early. One task reads the
connection and hands each call's parts to that call's handler; credits (``engine.bulk_frames``)
bound what waits unread per call, so a handler waiting for other senders never holds back
another call's parts. A frame out of place, a part past its credit or a sender silent past a
deadline drops the connection with its calls; a handler that fails ends its own call.
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
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_frames import (
    WINDOW,
    Credit,
    FrameError,
    Kind,
    keep_alive,
    read_count,
    read_frame,
    write_credit,
    write_frame,
)

__all__ = ["BulkServer", "Handler", "Tickets"]

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
TICKET_TTL_S = 60.0
"""How long a ticket's token may wait for its connection: a dial takes a few round trips."""
MAX_TICKETS = 4096
"""Outstanding tickets at most; past that the oldest is forgotten (a member asking in a loop
grows nothing)."""
HELLO_TIMEOUT_S = 10.0
"""From accept to the sender's token (the TLS handshake included)."""
IDLE_S = 1500.0
"""How long a connection may wait between calls; senders drop theirs sooner (``engine.bulk_client``)."""
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
MAX_CALLS = 64
"""Calls open at once on one connection (one per fragment averaged at once: 4 by default); a
sender that opens more breaks the protocol."""

Handler = Callable[[AsyncIterator[averaging_pb2.AveragingData], P2PContext], AsyncIterator[averaging_pb2.AveragingData]]


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

    def __init__(self, handler: Handler, local_id: PeerID, context: ssl.SSLContext, tickets: Tickets) -> None:
        self.handler, self.local_id, self.context, self.tickets = handler, local_id, context, tickets
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
    ) -> tuple[PeerID | None, asyncio.StreamReader, asyncio.StreamWriter | None]:
        """The TLS handshake and the sender's token, ``HELLO_TIMEOUT_S`` in all: the peer its
        ticket names (None: refused), and the connection's two ends."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                protocol = asyncio.StreamReaderProtocol(reader)
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn, ssl=self.context)
                writer = asyncio.StreamWriter(transport, protocol, reader, loop)
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
        peer = self.tickets.redeem(token) if kind == Kind.HELLO else None
        if peer is None:
            self.refused += 1
            logger.info("bulk connection refused: its token is not one this peer issued, or was used or expired")
        return peer, reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: PeerID) -> None:
        mine = self._by_peer.setdefault(peer, collections.deque())
        mine.append(writer)
        while len(mine) > PER_PEER:  # this member's oldest connection makes room
            mine.popleft().transport.abort()
        try:
            write_frame(writer, Kind.HELLO)
            await writer.drain()
            context = P2PContext(handle_name="bulk", local_id=self.local_id, remote_id=peer)
            await _Connection(self.handler, context, reader, writer).run()
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


class _Connection:
    """One sender's connection: reads every frame and hands each call's to that call."""

    def __init__(
        self, handler: Handler, context: P2PContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.handler, self.context, self.reader, self.writer = handler, context, reader, writer
        self.calls: dict[int, _Call] = {}
        self.last = 0
        """The highest call number seen: a number at most this and not open is a finished call."""

    async def run(self) -> None:
        try:
            while True:
                kind, number, payload = await asyncio.wait_for(read_frame(self.reader), IDLE_S)
                if kind == Kind.HELLO:
                    raise FrameError("a HELLO frame after the token")
                if number > self.last:
                    if kind != Kind.DATA:
                        raise FrameError(f"call {number} began with a {kind.name} frame")
                    if len(self.calls) >= MAX_CALLS:
                        raise FrameError(f"more than {MAX_CALLS} calls open at once")
                    self.last = number
                    self.calls[number] = _Call(self, number)
                call = self.calls.get(number)
                if call is None:
                    if kind == Kind.CREDIT:
                        read_count(payload)
                    continue  # a finished call: what the sender sent before it knew is dropped
                if kind == Kind.DATA:
                    call.receive(payload)
                elif kind == Kind.END:
                    call.end()
                elif kind == Kind.CLOSE:
                    call.close()
                else:
                    call.credit.grant(read_count(payload))
        finally:
            calls = [call.task for call in self.calls.values()]
            for task in calls:
                task.cancel()
            await asyncio.gather(*calls, return_exceptions=True)


class _Call:
    """One call on a connection: the sender's parts in, the handler's answers out."""

    def __init__(self, connection: _Connection, number: int) -> None:
        self.connection, self.number = connection, number
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.unread = WINDOW
        """Parts the sender may still send before this side credits more."""
        self.ended = False
        self.credit = Credit()
        """Averaged parts this side may still send back."""
        self.task = asyncio.create_task(self._answer())

    def receive(self, payload: bytes) -> None:
        if self.ended:
            raise FrameError(f"a DATA frame after the END of call {self.number}")
        if self.unread <= 0:
            raise FrameError(f"call {self.number} sent a part past its credit")
        self.unread -= 1
        self.queue.put_nowait(payload)

    def end(self) -> None:
        if self.ended:
            raise FrameError(f"a second END in call {self.number}")
        self.ended = True
        self.queue.put_nowait(None)

    def close(self) -> None:
        """The sender closed the call: a handler still waiting is cancelled."""
        self.connection.calls.pop(self.number, None)
        self.task.cancel()

    async def _answer(self) -> None:
        connection = self.connection
        writer = connection.writer
        answers = connection.handler(self._requests(), connection.context)
        try:
            try:
                async for message in answers:
                    await self.credit.take()
                    write_frame(writer, Kind.DATA, message.SerializeToString(), self.number)
                    await writer.drain()
            finally:
                if (close := getattr(answers, "aclose", None)) is not None:
                    await close()
        except asyncio.CancelledError:
            return  # closed by the sender, or the connection is gone
        except (ConnectionError, DecodeError) as exc:
            logger.debug("bulk call %d from %s failed: %s", self.number, connection.context.remote_id, exc)
        except Exception as exc:  # noqa: BLE001 - the handler refused the call (e.g. not a member)
            logger.info("bulk call from %s failed: %s: %s", connection.context.remote_id, type(exc).__name__, exc)
        if connection.calls.pop(self.number, None) is not None:
            write_frame(writer, Kind.END, call=self.number)
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    async def _requests(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        while (item := await self.queue.get()) is not None:
            self.unread += 1
            if not self.connection.writer.is_closing():
                write_credit(self.connection.writer, self.number)
            message = averaging_pb2.AveragingData()
            message.ParseFromString(item)
            yield message
