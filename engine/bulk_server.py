"""The reducer's end of the bulk channel (``engine.bulk_channel``): a TLS listener that takes
members' parts over plain TCP and hands them to the averager's own handler
(``rpc_aggregate_part``), as if they had come over a libp2p stream from the same peer.

Who may talk: only a connection whose first frame is the token of a ticket this averager issued
over libp2p (``Tickets``), to the peer the ticket names; each token works once, for
``TICKET_TTL_S``. Everything after that runs under that peer's identity: the handler checks
group membership, decodes and bounds the parts exactly as for a libp2p stream.

One connection carries one call at a time, and call after call (a sender keeps it for the next
round): a call is the sender's ``DATA`` frames and ``END``, the averaged parts back and this
side's ``END``, and the sender's ``CLOSE`` (``engine.bulk_frames``). A handler that fails, a
frame out of place or a sender silent past a deadline drops the connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import resource
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_frames import FrameError, Kind, keep_alive, read_frame, write_frame

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
CLOSE_WAIT_S = 15.0
"""After the handler's last message, how long the sender has to close the call (as
``engine.stream_close``)."""
MAX_CONNECTIONS = 4096
"""Connections open at once at most (members' pooled ones, one per sender and fragment: 1,020 in
a round of 256 with 4 fragments, and handshakes in progress), and never more than half the
process's file descriptors (``BulkServer.start`` raises its soft limit); past that new ones are
closed at once, and their senders use libp2p."""
QUEUED_PARTS = 4
"""Parts read ahead of the handler per call: past that this side stops reading, and TCP's flow
control holds the sender."""

Handler = Callable[[AsyncIterator[averaging_pb2.AveragingData], P2PContext], AsyncIterator[averaging_pb2.AveragingData]]


class Tickets:
    """Tokens issued over libp2p, each for one peer, single use, valid ``TICKET_TTL_S``."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, most: int = MAX_TICKETS) -> None:
        self.ttl_s, self.most = ttl_s, most
        self._issued: collections.OrderedDict[bytes, tuple[PeerID, float]] = collections.OrderedDict()

    def issue(self, peer: PeerID) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        self._issued[token] = (peer, time.monotonic() + self.ttl_s)
        while len(self._issued) > self.most:
            self._issued.popitem(last=False)
        return token

    def redeem(self, token: bytes) -> PeerID | None:
        """The peer ``token`` was issued to, once; None for a token unknown, used or expired."""
        found = self._issued.pop(token, None)
        if found is None:
            return None
        peer, expires = found
        return peer if time.monotonic() <= expires else None

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
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.Task[Any]] = set()

    async def start(self, host: str | None = None, port: int = 0) -> int:
        """Listen on ``host`` (None: every interface) at ``port`` (0: any free one); the port."""
        self.most = min(MAX_CONNECTIONS, _raise_descriptor_limit() // 2)
        self._server = await asyncio.start_server(
            self._accepted, host=host, port=port, ssl=self.context, ssl_handshake_timeout=HELLO_TIMEOUT_S
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()
        if self._open:
            await asyncio.gather(*self._open, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._open) >= self.most:
            self.refused += 1
            writer.close()
            return
        self._open.add(task)
        try:
            await self._serve(reader, writer)
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            FrameError,
            TimeoutError,
            ssl.SSLError,
            DecodeError,
        ) as exc:
            logger.debug("bulk connection dropped: %s: %s", type(exc).__name__, exc)
        except Exception as exc:  # noqa: BLE001 - the handler refused the call (e.g. not a member)
            logger.info("bulk connection dropped: the call failed: %s: %s", type(exc).__name__, exc)
        except asyncio.CancelledError:  # the listener stops (``stop``): the connection goes quietly
            pass
        finally:
            self._open.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        try:
            kind, token = await asyncio.wait_for(read_frame(reader, limit=TOKEN_BYTES), HELLO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, FrameError, TimeoutError) as exc:
            self.refused += 1
            logger.info("bulk connection refused: no token (%s)", type(exc).__name__)
            return
        peer = self.tickets.redeem(token) if kind == Kind.HELLO else None
        if peer is None:
            self.refused += 1
            logger.info("bulk connection refused: its token is not one this peer issued, or was used or expired")
            return
        write_frame(writer, Kind.HELLO)
        await writer.drain()
        context = P2PContext(handle_name="bulk", local_id=self.local_id, remote_id=peer)
        while True:
            kind, payload = await asyncio.wait_for(read_frame(reader), IDLE_S)
            if kind != Kind.DATA:
                raise FrameError(f"a call began with a {kind.name} frame")
            await _Call(self.handler, context, reader, writer, payload).run()


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


class _Call:
    """One call on a connection: the sender's parts in, the handler's answers out."""

    def __init__(
        self,
        handler: Handler,
        context: P2PContext,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        first: bytes,
    ) -> None:
        self.handler, self.context, self.reader, self.writer = handler, context, reader, writer
        self.queue: asyncio.Queue[bytes | None | BaseException] = asyncio.Queue(QUEUED_PARTS)
        self.queue.put_nowait(first)
        self.closed = asyncio.Event()
        """The sender's ``CLOSE`` came."""
        self.handler_done = False

    async def run(self) -> None:
        pump = asyncio.create_task(self._pump())
        serve = asyncio.create_task(self._answer())
        try:
            # the sender's CLOSE (the pump ends) cancels a handler still waiting
            await asyncio.wait({pump, serve}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not serve.done():
                pump.result()  # a broken connection raises here
                serve.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serve
            else:
                serve.result()  # a failed handler drops the connection
            write_frame(self.writer, Kind.END)
            await self.writer.drain()
            await asyncio.wait_for(asyncio.shield(pump), CLOSE_WAIT_S)
        finally:
            for task in (pump, serve):
                task.cancel()
            await asyncio.gather(pump, serve, return_exceptions=True)

    async def _answer(self) -> None:
        try:
            async for message in self.handler(self._requests(), self.context):
                write_frame(self.writer, Kind.DATA, message.SerializeToString())
                await self.writer.drain()
        finally:
            self.handler_done = True
            while not self.queue.empty():  # parts nobody will read: a waiting pump moves on
                self.queue.get_nowait()

    async def _pump(self) -> None:
        """Reads this call's frames until the sender's ``CLOSE``."""
        ended = False
        try:
            while True:
                kind, payload = await read_frame(self.reader)
                if kind == Kind.CLOSE:
                    self.closed.set()
                    return
                if kind not in (Kind.DATA, Kind.END) or ended:
                    raise FrameError(f"a {kind.name} frame in the middle of a call")
                if self.handler_done:
                    ended = kind == Kind.END
                    continue  # the handler is gone: what it would have read is dropped
                ended = kind == Kind.END
                await self.queue.put(payload if kind == Kind.DATA else None)
        except BaseException as exc:
            if not self.handler_done:
                with contextlib.suppress(asyncio.QueueFull):
                    self.queue.put_nowait(exc)
            raise

    async def _requests(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise ConnectionError(f"the sender's connection broke: {type(item).__name__}")
            message = averaging_pb2.AveragingData()
            message.ParseFromString(item)
            yield message
