"""Frames read off a bulk connection (``engine.bulk_frames``) with no stream buffer between TLS
and the frame's consumer.

asyncio's ``StreamReader`` gathers what TLS decrypted into one buffer, copies each frame out of
it and moves what is left to the buffer's start: two more passes over every byte received, in
chunks of the buffer's limit, each a wake-up of a waiting task. ``FrameProtocol`` copies what TLS
decrypted once, into a buffer of the frame's own size, and that buffer is what the consumer
gets. Measured on loopback here, one process sending itself 640 KiB frames over TLS, send and
receive together: 3.4-3.6 Gbit per CPU second through ``StreamReader``, 5.2-5.3 through this
protocol, on uvloop (the averager's loop) and asyncio's alike. (asyncio's buffered protocols,
decrypting straight into the frame's buffer, measured 6.1-6.5 on asyncio's loop, but uvloop
0.23 leaves data that came in with the TLS handshake unread behind them, until more arrives:
a dialler's token, then, until the listener gives up on it.)

``FrameReader.read`` is ``bulk_frames.read_frame`` for such a connection, with the same errors:
``asyncio.IncompleteReadError`` at the end of the stream, ``FrameError`` for a frame the
protocol does not have, the connection's own error where it broke. The protocol parses frames as
they arrive, so a frame's length is checked against ``FrameProtocol.limit`` before anything is
allocated for it (a listener's first frame is at most a token's size), and ``read(limit)``
checks it again. Frames read but not yet taken are bounded: past ``BUFFERED_BYTES`` the protocol
stops reading the socket until they are taken, as a ``StreamReader`` does past twice its limit.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from asyncio.streams import FlowControlMixin
from typing import Any

from engine.bulk_frames import MAX_FRAME_BYTES, FrameError, Kind

__all__ = ["BUFFERED_BYTES", "FrameProtocol", "FrameReader", "open_frames"]

BUFFERED_BYTES = 4 * 2**20
"""Payload bytes read and not yet taken past which the protocol pauses the socket (the link's
reader hands every frame on at once; its calls' own queues are bounded by credits)."""

_HEADER = struct.Struct(">BII")
_KINDS = frozenset(int(kind) for kind in Kind)


class FrameReader:
    """The frames one ``FrameProtocol`` has read, in order, for one consumer."""

    def __init__(self, protocol: FrameProtocol) -> None:
        self._protocol = protocol
        self._frames: collections.deque[tuple[Kind, int, bytes | bytearray]] = collections.deque()
        self._buffered = 0
        self._end: BaseException | None = None
        """Why no more frames come (after those queued): the stream's end, an error."""
        self._waiter: asyncio.Future[None] | None = None

    async def read(self, limit: int = MAX_FRAME_BYTES) -> tuple[Kind, int, bytes | bytearray]:
        """The next frame; a payload of more than ``limit`` bytes is a ``FrameError``."""
        while not self._frames:
            if self._end is not None:
                raise self._end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        kind, call, payload = self._frames.popleft()
        self._buffered -= len(payload)
        self._protocol.taken(self._buffered)
        if len(payload) > limit:
            raise FrameError(f"a frame of {len(payload)} bytes (at most {limit})")
        return kind, call, payload

    def put(self, frame: tuple[Kind, int, bytes | bytearray]) -> int:
        """(The protocol's.) One more frame; the payload bytes now waiting."""
        self._frames.append(frame)
        self._buffered += len(frame[2])
        self._wake()
        return self._buffered

    def stop(self, why: BaseException) -> None:
        """(The protocol's.) No frames after those waiting: ``why`` is raised once they are read."""
        if self._end is None:
            self._end = why
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class FrameProtocol(FlowControlMixin, asyncio.Protocol):
    """One bulk connection's protocol: frames in (``reader``), flow control for the
    ``asyncio.StreamWriter`` that writes to it (``drain``)."""

    def __init__(self, limit: int = MAX_FRAME_BYTES, *, first: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(loop=loop)
        self.limit = first if first is not None else limit
        """The largest payload the protocol takes next (checked on the header, before the
        payload): ``first`` for the first frame (a listener's: a token's size), then ``limit``."""
        self._then = limit
        self.reader = FrameReader(self)
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(_HEADER.size)
        self._payload: bytearray | None = None
        self._view = memoryview(self._header)
        self._have = 0
        self._frame: tuple[Kind, int] | None = None
        self._reading_paused = False
        self._failed = False
        self._closed = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        """What TLS decrypted: copied once, into the header or the payload of the frame it
        belongs to (a payload's buffer is the frame's own, handed on whole)."""
        chunk, at = memoryview(data), 0
        while at < len(chunk) and not self._failed:
            take = min(len(chunk) - at, len(self._view) - self._have)
            self._view[self._have : self._have + take] = chunk[at : at + take]
            self._have += take
            at += take
            if self._have == len(self._view):
                self._frame_read()

    def _frame_read(self) -> None:
        """A header or a payload is whole."""
        if self._frame is None:
            kind, call, length = _HEADER.unpack(self._header)
            if length > self.limit:
                return self._fail(FrameError(f"a frame of {length} bytes (at most {self.limit})"))
            if kind not in _KINDS:
                return self._fail(FrameError(f"a frame of unknown kind {kind}"))
            self.limit = self._then
            if length:
                self._frame = (Kind(kind), call)
                self._payload = bytearray(length)
                self._view, self._have = memoryview(self._payload), 0
                return
            self._deliver((Kind(kind), call, b""))
        else:
            assert self._payload is not None
            self._deliver((*self._frame, self._payload))
            self._frame = self._payload = None
        self._view, self._have = memoryview(self._header), 0

    def _deliver(self, frame: tuple[Kind, int, bytes | bytearray]) -> None:
        if self.reader.put(frame) > BUFFERED_BYTES and not self._reading_paused:
            self._reading_paused = True
            self._pause()

    def _pause(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def taken(self, buffered: int) -> None:
        """The reader took a frame; ``buffered`` bytes are left waiting."""
        if self._reading_paused and buffered <= BUFFERED_BYTES // 2 and self.transport is not None:
            self._reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def _fail(self, error: FrameError) -> None:
        """A frame this protocol does not have: nothing more is read; the reader raises
        ``error`` after the frames before it, and its consumer drops the connection."""
        self._failed = True
        self.reader.stop(error)
        self._pause()

    def eof_received(self) -> bool:
        self.reader.stop(self._incomplete())
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # wakes a writer waiting in drain
        self.reader.stop(exc if exc is not None else self._incomplete())
        if not self._closed.done():
            self._closed.set_result(None)

    def _incomplete(self) -> asyncio.IncompleteReadError:
        """The stream's end where the next frame should be (or mid-frame), as ``readexactly``
        reports it."""
        expected = len(self._view) if self._have or self._frame is not None else _HEADER.size
        return asyncio.IncompleteReadError(bytes(self._view[: self._have]), expected)

    def _get_close_waiter(self, stream: Any) -> asyncio.Future[None]:  # asyncio.StreamWriter.wait_closed
        return self._closed


async def open_frames(host: str, port: int, **kwargs: Any) -> tuple[FrameReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` for a bulk connection: its frames and a writer."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(FrameProtocol, host, port, **kwargs)
    return protocol.reader, asyncio.StreamWriter(transport, protocol, None, loop)
