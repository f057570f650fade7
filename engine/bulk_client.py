"""The sender's end of the bulk channel (``engine.bulk_channel``): connections to reducers, kept
between rounds, and the call that streams parts over one of them.

``BulkPool.open(peer)`` returns the connection to ``peer``'s bulk listener, or None where there
is none (yet): the caller then uses the libp2p stream, as before. One connection per reducer
carries every call to it at once (one per fragment, ``engine.bulk_frames``), so a round of 256
opens 255 at a peer, not 1,020, and a small router buffer sees one flow's opening burst per
pair, not four. A kept connection costs nothing.
A new one costs a ticket over libp2p (one round trip, and the libp2p dial if there is no
connection yet), the TCP and TLS handshakes (two) and the token's answer (one); a call waits
``QUICK_S`` for it, and past that takes libp2p while the dial goes on for the next round. So a
port a firewall drops, or handshakes that lose packets on a saturated link, cost a round at most
``QUICK_S`` once. A peer that could not be reached directly (it does not listen, its libp2p
connection is relayed, the dial or the handshake failed) is not tried again for ``NO_PATH_S``.

Nothing here cancels a ticket's call early: cancelled while it dials, the libp2p daemon marks the
peer as failed and refuses to dial it for a while (its dial backoff), and the libp2p stream the
sender then falls back to fails too. A 4-host benchmark on saturated 50 Mbit/s links lost
reducers that way with a 5 s deadline on the ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_frames import (
    MAX_CALL,
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
from engine.bulk_tls import client_context, fingerprint

__all__ = ["BulkCall", "BulkConnection", "BulkPool", "Ticket", "direct_hosts"]

logger = logging.getLogger(__name__)

DIAL_S = 60.0
"""A new connection's budget (in the background past ``QUICK_S``): the ticket, the TCP and TLS
handshakes and the token's answer; generous, see above."""
QUICK_S = 2.0
"""How long a call waits for a new connection before it takes libp2p: four round trips on a long
link, with room for a loaded machine."""
IDLE_S = 1200.0
"""An idle connection older than this is closed rather than used: rounds are minutes apart, and
keepalive (``engine.bulk_frames.keep_alive``) holds the path open meanwhile; the reducer keeps
its end ``engine.bulk_server.IDLE_S``, longer, so that a connection taken is never one it just
closed."""
WRAP_UP_S = 2.0
"""How long closing a call waits for the rest of its request stream (which a sender ends once it
holds every averaged part) before it cancels it and tells the reducer to stop."""
NO_PATH_S = 600.0
"""How long a peer that could not be reached directly (no listener, a dial or handshake that
failed) is left to libp2p; a ticket's libp2p call that failed is asked again at the next call."""
CONNECT_S = 10.0
"""One address's TCP and TLS handshakes at most (a dropped SYN is sent again after 1 s and 3 s)."""


class Ticket:
    """What a reducer answers over libp2p: where it listens, its certificate's pin, a token."""

    def __init__(self, port: int, pin: bytes, token: bytes) -> None:
        self.port, self.pin, self.token = port, pin, token


TicketCall = Callable[[PeerID], Awaitable[Ticket | None]]
HostsCall = Callable[[PeerID], Awaitable[list[str]]]


def direct_hosts(addrs: Iterable[Any]) -> list[str]:
    """The IP addresses among libp2p multiaddrs that reach a peer directly (``/ip4/…/tcp/…`` or
    ``/ip6/…``), in their order; relayed ones (``/p2p-circuit``) are none."""
    hosts: list[str] = []
    for addr in addrs:
        parts = str(addr).split("/")
        if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        if parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


class BulkConnection:
    """One authenticated TLS connection to a reducer, carrying every call to it at once: one
    task reads it and hands each call its frames."""

    def __init__(
        self, pool: BulkPool, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.pool, self.peer, self.reader, self.writer = pool, peer, reader, writer
        self.idle_since = time.monotonic()
        self.calls: dict[int, BulkCall] = {}
        self.next = 1
        """The next call's number (rising: a number is never used twice on a connection, so an
        answer to a call given up is never taken for an answer to a later one)."""
        self.broken: BaseException | None = None
        self._reading = asyncio.create_task(self._read())

    def call(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> BulkCall:
        return BulkCall(self, requests)

    def number(self, call: BulkCall) -> int:
        """The next call number, for ``call``'s first frame: numbers are handed out as first
        frames are written, so the reducer sees them rise (several calls start at once)."""
        if self.broken is not None:
            raise ConnectionError(f"the bulk connection broke: {type(self.broken).__name__}")
        if self.next >= MAX_CALL:
            raise ConnectionError("this bulk connection used every call number")
        number, self.next = self.next, self.next + 1
        self.calls[number] = call
        return number

    def usable(self) -> bool:
        return (
            self.broken is None
            and not self.writer.is_closing()
            and (bool(self.calls) or time.monotonic() - self.idle_since < IDLE_S)
        )

    def close(self) -> None:
        self._reading.cancel()
        self.writer.close()

    def forget(self, call: BulkCall) -> None:
        if call.number and self.calls.pop(call.number, None) is not None and not self.calls:
            self.idle_since = time.monotonic()

    async def _read(self) -> None:
        try:
            while True:
                kind, number, payload = await read_frame(self.reader)
                if kind in (Kind.HELLO, Kind.CLOSE) or not 0 < number < self.next:
                    raise FrameError(f"the reducer sent a {kind.name} frame for call {number}")
                call = self.calls.get(number)
                if call is None:  # a call this side gave up: whatever the reducer sent is dropped
                    if kind == Kind.CREDIT:
                        read_count(payload)
                    continue
                if kind == Kind.DATA:
                    call.receive(payload)
                elif kind == Kind.END:
                    call.end()
                else:
                    call.credit.grant(read_count(payload))
        except asyncio.CancelledError:
            self.broken = ConnectionError("the bulk connection was closed")
        except Exception as exc:  # noqa: BLE001 - the connection is gone, with every call on it
            logger.debug("bulk connection to %s broken: %s: %s", self.peer, type(exc).__name__, exc)
            self.broken = exc
        assert self.broken is not None
        self.writer.close()
        for call in list(self.calls.values()):
            call.fail(self.broken)


class BulkCall:
    """Sends ``requests`` as ``DATA`` frames (then ``END``) while the averaged parts are read
    back: the async iterator hivemind's stub would return, with ``aclose``."""

    def __init__(self, connection: BulkConnection, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        self.connection = connection
        self.number = 0
        """Given with the first part (``BulkConnection.number``); 0 before."""
        self.queue: asyncio.Queue[bytes | None | BaseException] = asyncio.Queue()
        self.unread = WINDOW
        """Averaged parts the reducer may still send before this side credits more."""
        self.credit = Credit()
        """Parts this side may still send."""
        self._end_read = False
        """The reducer's ``END`` arrived (it may still wait in the queue)."""
        self._ended = False
        """The reducer's ``END`` was read: the reducer has forgotten this call."""
        self._closed = False
        self._sender = asyncio.create_task(self._send(requests))

    async def _send(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        writer = self.connection.writer
        try:
            async for message in requests:
                await self.credit.take()
                if not self.number:
                    self.number = self.connection.number(self)
                write_frame(writer, Kind.DATA, message.SerializeToString(), self.number)
                await writer.drain()
            if not self.number:  # nothing to send: a call is never opened by its end
                self.end()
                return
            write_frame(writer, Kind.END, call=self.number)
            await writer.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader learns it; aclose tells the reducer
            self.queue.put_nowait(ConnectionError(f"bulk call failed sending: {type(exc).__name__}: {exc}"))

    def receive(self, payload: bytes) -> None:
        """An averaged part from the connection's reader; ``FrameError`` (the connection breaks)
        for one past this call's credit or after its ``END``."""
        if self._end_read or self.unread <= 0:
            raise FrameError(f"the reducer sent call {self.number} a part past its credit or its END")
        self.unread -= 1
        self.queue.put_nowait(payload)

    def end(self) -> None:
        if self._end_read:
            raise FrameError(f"a second END in call {self.number}")
        self._end_read = True
        self.queue.put_nowait(None)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc if isinstance(exc, BaseException) else ConnectionError(str(exc)))

    def __aiter__(self) -> BulkCall:
        return self

    async def __anext__(self) -> averaging_pb2.AveragingData:
        if self._ended or self._closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is None:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)  # every later read fails the same way
            if isinstance(item, ConnectionError):
                raise item
            raise ConnectionError(f"the bulk connection broke: {type(item).__name__}: {item}") from None
        self.unread += 1
        if not self.connection.writer.is_closing():
            write_credit(self.connection.writer, self.number)
        message = averaging_pb2.AveragingData()
        message.ParseFromString(item)
        return message

    async def aclose(self) -> None:
        """End the call: parts not yet sent are not, and a reducer still serving it is told to
        stop (``CLOSE``); the connection stays for other calls and the next round."""
        if self._closed:
            return
        self._closed = True
        connection = self.connection
        connection.forget(self)
        if not self._sender.done() and connection.broken is None:
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._sender), WRAP_UP_S)
        self._sender.cancel()
        await asyncio.gather(self._sender, return_exceptions=True)
        if self.number and not self._end_read and not connection.writer.is_closing():
            write_frame(connection.writer, Kind.CLOSE, call=self.number)


class _NoTicket(Exception):
    """The ticket's libp2p call failed (a dial that failed or is backing off, a reset stream):
    unlike an answer without a ticket or a listener that cannot be reached, this says nothing
    about a direct path, so the next call asks again rather than leave the peer to libp2p for
    ``NO_PATH_S``. (A first round's ticket to a peer not yet connected failed this way in a 4-host
    ``benchmarks.wan_averaging`` run: libp2p's dial backoff, from an earlier failed dial, refused
    it, and every later round of the run then went over libp2p to that peer.)"""


class BulkPool:
    """One connection per reducer, kept between calls and rounds."""

    def __init__(
        self, ticket: TicketCall, hosts: HostsCall, *, dial_s: float = DIAL_S, quick_s: float = QUICK_S
    ) -> None:
        self._ticket, self._hosts, self.dial_s, self.quick_s = ticket, hosts, dial_s, quick_s
        self._connections: dict[PeerID, BulkConnection] = {}
        self._dialing: dict[PeerID, asyncio.Task[BulkConnection | None]] = {}
        self._no_path: dict[PeerID, float] = {}
        self.dials = 0
        """New connections made (for tests and logs: a kept connection is not dialled again)."""
        self._context: ssl.SSLContext | None = None

    async def open(self, peer: PeerID) -> BulkConnection | None:
        """The connection to ``peer``, kept or new (the calls of a round's fragments share one,
        and share its dial); None where there is no direct path."""
        kept = self._connections.get(peer)
        if kept is not None:
            if kept.usable():
                return kept
            del self._connections[peer]
            kept.close()
        if self._no_path.get(peer, 0.0) > time.monotonic():
            return None
        dial = self._dialing.get(peer)
        if dial is None:
            dial = self._dialing[peer] = asyncio.ensure_future(self._dial_or_none(peer))
            dial.add_done_callback(lambda _: self._dialing.pop(peer, None))
        try:
            return await asyncio.wait_for(asyncio.shield(dial), self.quick_s)
        except TimeoutError:  # too slow for this call: the dial goes on, and the next call takes it
            return None

    async def _dial_or_none(self, peer: PeerID) -> BulkConnection | None:
        connection: BulkConnection | None = None
        try:
            async with asyncio.timeout(self.dial_s):
                connection = await self._dial(peer)
        except _NoTicket as exc:  # libp2p could not reach the peer now: the next call asks again
            logger.info("no bulk ticket from %s (%s); its parts go over libp2p", peer, exc)
            return None
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure means: use libp2p
            logger.info("no bulk connection to %s (%s: %s); its parts go over libp2p", peer, type(exc).__name__, exc)
        if connection is None:
            self._no_path[peer] = time.monotonic() + NO_PATH_S
        else:
            self._connections[peer] = connection
        return connection

    def kept(self, peer: PeerID) -> int:
        """Connections to ``peer`` kept for the next call (0 or 1)."""
        connection = self._connections.get(peer)
        return int(connection is not None and connection.usable())

    def close(self) -> None:
        for dial in list(self._dialing.values()):
            dial.cancel()
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    async def _dial(self, peer: PeerID) -> BulkConnection | None:
        try:
            ticket = await self._ticket(peer)
        except Exception as exc:  # the libp2p call failed, not the reducer's answer
            raise _NoTicket(f"{type(exc).__name__}: {exc}") from exc
        if ticket is None or ticket.port == 0:
            return None
        hosts = await self._hosts(peer)
        if not hosts:
            return None
        if self._context is None:
            self._context = client_context()
        last: BaseException | None = None
        for host in hosts:
            try:
                async with asyncio.timeout(CONNECT_S):
                    reader, writer = await asyncio.open_connection(
                        host, ticket.port, ssl=self._context, server_hostname=""
                    )
            except (OSError, TimeoutError) as exc:
                last = exc
                continue
            try:
                keep_alive(writer)
                der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if der is None or fingerprint(der) != ticket.pin:
                    raise ConnectionError(
                        f"{host}:{ticket.port} presented another certificate than {peer}'s ticket pins"
                    )
                write_frame(writer, Kind.HELLO, ticket.token)
                await writer.drain()
                kind, _call, _ = await read_frame(reader, limit=0)
                if kind != Kind.HELLO:
                    raise FrameError(f"the reducer answered the token with a {kind.name} frame")
            except BaseException:
                writer.close()
                raise
            self.dials += 1
            return BulkConnection(self, peer, reader, writer)
        raise ConnectionError(f"no direct address of {peer} took a connection: {last}")
