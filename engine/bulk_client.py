"""The sender's end of the bulk channel (``engine.bulk_channel``): connections to reducers, kept
between rounds, and the call that streams parts over one of them.

``BulkPool.open(peer)`` returns a connection to ``peer``'s bulk listener, or None where there is
none (yet): the caller then uses the libp2p stream, as before. A kept connection costs nothing.
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
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_frames import FrameError, Kind, keep_alive, read_frame, write_frame
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
NO_PATH_S = 600.0
"""How long a peer that could not be reached directly is left to libp2p."""
CONNECT_S = 10.0
"""One address's TCP and TLS handshakes at most (a dropped SYN is sent again after 1 s and 3 s)."""
WRAP_UP_S = 2.0
"""After the last averaged part, how long a call may take to end cleanly (its request stream's
end, the reducer's ``END``) for its connection to be kept; past that it is closed."""
IDLE_PER_PEER = 8
"""Idle connections kept per reducer (one per fragment averaged at once)."""


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
    """One authenticated TLS connection to a reducer; one call at a time."""

    def __init__(
        self, pool: BulkPool, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.pool, self.peer, self.reader, self.writer = pool, peer, reader, writer
        self.idle_since = time.monotonic()

    def call(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> BulkCall:
        return BulkCall(self, requests)

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and time.monotonic() - self.idle_since < IDLE_S

    def close(self) -> None:
        self.writer.close()


class BulkCall:
    """Sends ``requests`` as ``DATA`` frames (then ``END``) while the averaged parts are read
    back: the async iterator hivemind's stub would return, with ``aclose``."""

    def __init__(self, connection: BulkConnection, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        self.connection = connection
        self._ended = False
        """The reducer's ``END`` was read."""
        self._closed = False
        self._broken = False
        """A read of this call was cut short (a timeout, a cancellation, a bad frame): the
        connection may stand in the middle of a frame, so it is never used again (the rest of
        that frame read as a new one could pass an old averaged part off as a new one)."""
        self._sender = asyncio.create_task(self._send(requests))

    async def _send(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        writer = self.connection.writer
        try:
            async for message in requests:
                write_frame(writer, Kind.DATA, message.SerializeToString())
                await writer.drain()
            write_frame(writer, Kind.END)
            await writer.drain()
        except BaseException:
            # the reducer must not take a partial request stream for a whole one
            self.connection.close()
            raise

    def __aiter__(self) -> BulkCall:
        return self

    async def __anext__(self) -> averaging_pb2.AveragingData:
        if self._ended or self._closed:
            raise StopAsyncIteration
        try:
            kind, payload = await read_frame(self.connection.reader)
        except BaseException as exc:
            self._broken = True
            if not isinstance(exc, asyncio.IncompleteReadError):
                raise
            if self._sender.done() and not self._sender.cancelled() and self._sender.exception() is not None:
                raise ConnectionError(f"bulk call failed sending: {self._sender.exception()}") from None
            raise ConnectionError("the reducer closed the bulk connection") from None
        if kind == Kind.END:
            self._ended = True
            raise StopAsyncIteration
        if kind != Kind.DATA:
            self._broken = True
            raise FrameError(f"the reducer sent a {kind.name} frame in a call")
        message = averaging_pb2.AveragingData()
        message.ParseFromString(payload)
        return message

    async def aclose(self) -> None:
        """End the call: the connection goes back to the pool if the call ended cleanly in time."""
        if self._closed:
            return
        self._closed = True
        connection = self.connection
        try:
            if self._broken:
                raise ConnectionError("a read of this call was cut short")
            await asyncio.wait_for(asyncio.shield(self._sender), WRAP_UP_S)
            write_frame(connection.writer, Kind.CLOSE)
            await connection.writer.drain()
            deadline = time.monotonic() + WRAP_UP_S
            while not self._ended:  # the reducer's END, whatever averaged parts come before it
                kind, _payload = await asyncio.wait_for(read_frame(connection.reader), deadline - time.monotonic())
                self._ended = kind == Kind.END
        except (Exception, asyncio.CancelledError) as exc:
            logger.debug("bulk call to %s not ended cleanly (%s): connection closed", connection.peer, exc)
            self._sender.cancel()
            connection.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        connection.pool.release(connection)


class BulkPool:
    """Connections to reducers, by peer, kept between calls."""

    def __init__(
        self, ticket: TicketCall, hosts: HostsCall, *, dial_s: float = DIAL_S, quick_s: float = QUICK_S
    ) -> None:
        self._ticket, self._hosts, self.dial_s, self.quick_s = ticket, hosts, dial_s, quick_s
        self._idle: dict[PeerID, list[BulkConnection]] = {}
        self._dialing: set[asyncio.Task[BulkConnection | None]] = set()
        self._no_path: dict[PeerID, float] = {}
        self.dials = 0
        """New connections made (for tests and logs: a kept connection is not dialled again)."""
        self._context: ssl.SSLContext | None = None

    async def open(self, peer: PeerID) -> BulkConnection | None:
        """A connection to ``peer``, kept or new; None where there is no direct path."""
        idle = self._idle.get(peer, [])
        while idle:
            kept = idle.pop()
            if kept.usable():
                return kept
            kept.close()
        if self._no_path.get(peer, 0.0) > time.monotonic():
            return None
        dial = asyncio.ensure_future(self._dial_or_none(peer))
        self._dialing.add(dial)
        dial.add_done_callback(self._dialing.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(dial), self.quick_s)
        except (TimeoutError, asyncio.CancelledError) as exc:  # too slow for this call: the next takes it
            dial.add_done_callback(self._keep_dialled)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None

    async def _dial_or_none(self, peer: PeerID) -> BulkConnection | None:
        connection: BulkConnection | None = None
        try:
            async with asyncio.timeout(self.dial_s):
                connection = await self._dial(peer)
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure means: use libp2p
            logger.info("no bulk connection to %s (%s: %s); its parts go over libp2p", peer, type(exc).__name__, exc)
        if connection is None:
            self._no_path[peer] = time.monotonic() + NO_PATH_S
        return connection

    def _keep_dialled(self, dial: asyncio.Task[BulkConnection | None]) -> None:
        if not dial.cancelled() and dial.exception() is None and (connection := dial.result()) is not None:
            self.release(connection)

    def kept(self, peer: PeerID) -> int:
        """Idle connections to ``peer`` kept for the next call."""
        return len(self._idle.get(peer, []))

    def release(self, connection: BulkConnection) -> None:
        idle = self._idle.setdefault(connection.peer, [])
        if len(idle) >= IDLE_PER_PEER or not connection.usable():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def close(self) -> None:
        for dial in list(self._dialing):
            dial.cancel()
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    async def _dial(self, peer: PeerID) -> BulkConnection | None:
        ticket = await self._ticket(peer)
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
                kind, _ = await read_frame(reader, limit=0)
                if kind != Kind.HELLO:
                    raise FrameError(f"the reducer answered the token with a {kind.name} frame")
            except BaseException:
                writer.close()
                raise
            self.dials += 1
            return BulkConnection(self, peer, reader, writer)
        raise ConnectionError(f"no direct address of {peer} took a connection: {last}")
