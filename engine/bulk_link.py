"""One bulk connection between two members, carrying the calls of both (``engine.bulk_channel``).

A member that reduces gets parts from every other member and sends parts to every other
reducer, so two reducers trade parts both ways. Over libp2p the two directions share one
connection per pair; over the bulk channel they share one too (``BulkLink``): one end dialled
it (``engine.bulk_client``), the other accepted it (``engine.bulk_server``), and each makes its
own calls on it and answers the other's. Two connections per pair would double the flows on
every member's uplink, each restarting from idle every round: on a 5 Mbit/s link with a small
router buffer their opening bursts lost 2.6% of the segments, against libp2p's 0.1%
(docs/design/gaps.md 2).

Calls are numbered by the end that makes them: the dialler's odd (1, 3, ...), the acceptor's
even (2, 4, ...), each end's rising, so a frame's number says whose call it is. Each end knows
the other's identity: the acceptor by the token of a ticket it gave the dialler over libp2p, the
dialler by the certificate that ticket pins. A call made by either end runs under the other's
identity at the answering end (``P2PContext.remote_id``), through the averager's own handler, as
a libp2p stream from that peer would.

Frames, credits and their limits are ``engine.bulk_frames``'s. A frame out of place (a call the
other end never made, an answer past its credit, a new call that does not begin with a part)
drops the link with every call on it, both ways; a handler that fails ends its own call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.bulk_frames import (
    MAX_CALL,
    WINDOW,
    Credit,
    FrameError,
    Kind,
    read_count,
    read_frame,
    write_credit,
    write_frame,
)
from engine.bulk_reader import FrameReader

__all__ = ["MAX_CALLS", "BulkCall", "BulkLink", "Handler"]

logger = logging.getLogger(__name__)

Handler = Callable[[AsyncIterator[averaging_pb2.AveragingData], P2PContext], AsyncIterator[averaging_pb2.AveragingData]]

IDLE_S = 3600.0
"""How long a link may carry no frame before its reader drops it: a member gone from the swarm
without a word (its process alive, its averager out of rounds). Rounds are minutes apart;
keepalive holds the path open meanwhile."""
WRAP_UP_S = 2.0
"""How long closing a call waits for the rest of its request stream (which a sender ends once it
holds every averaged part) before it cancels it and tells the other end to stop."""
MAX_CALLS = 64
"""Calls the other end may have open at once on one link (one per fragment averaged at once: 4
by default); one that opens more breaks the protocol."""


class BulkLink:
    """One authenticated TLS connection to ``peer``: this end's calls to it (``call``) and its
    calls to this end (answered with ``handler``); one task reads it and hands each call its
    frames. ``dialled``: this end made the connection (its calls are odd)."""

    def __init__(
        self,
        peer: PeerID,
        reader: FrameReader,
        writer: asyncio.StreamWriter,
        *,
        dialled: bool,
        handler: Handler | None,
        local_id: PeerID,
        on_close: Callable[[BulkLink], None] | None = None,
    ) -> None:
        self.peer, self.reader, self.writer, self.dialled = peer, reader, writer, dialled
        self.handler = handler
        self.context = P2PContext(handle_name="bulk", local_id=local_id, remote_id=peer)
        self.on_close = on_close
        self.created = self.idle_since = time.monotonic()
        self.outgoing: dict[int, BulkCall] = {}
        self.incoming: dict[int, ServedCall] = {}
        self.next = 1 if dialled else 2
        """This end's next call number (rising by 2: a number is never used twice on a link, so an
        answer to a call given up is never taken for an answer to a later one)."""
        self.last_in = 0
        """The other end's highest call number yet: one at most this and not open has finished."""
        self.broken: BaseException | None = None
        self.retired = False
        """No new calls: the pair has another link (``engine.bulk_client.BulkPool``)."""
        self._reading = asyncio.create_task(self._read())

    def mine(self, number: int) -> bool:
        """Whether call ``number`` is one this end makes."""
        return number % 2 == (1 if self.dialled else 0)

    def call(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> BulkCall:
        """A call to the other end: ``requests`` go out, its answers come back."""
        return BulkCall(self, requests)

    def number(self, call: BulkCall) -> int:
        """The next call number, for ``call``'s first frame: numbers are handed out as first
        frames are written, so the other end sees them rise (several calls start at once)."""
        if self.broken is not None:
            raise ConnectionError(f"the bulk connection broke: {type(self.broken).__name__}")
        if self.next >= MAX_CALL - 1:
            raise ConnectionError("this bulk connection used every call number")
        number, self.next = self.next, self.next + 2
        self.outgoing[number] = call
        return number

    def busy(self) -> bool:
        return bool(self.outgoing or self.incoming)

    def alive(self) -> bool:
        return self.broken is None and not self.writer.is_closing()

    def idle_for(self) -> float:
        return 0.0 if self.busy() else time.monotonic() - self.idle_since

    def close(self) -> None:
        self._reading.cancel()
        self.writer.close()

    async def closed(self) -> None:
        """Until the link is gone (its reader ended)."""
        await asyncio.gather(self._reading, return_exceptions=True)

    def forget(self, call: BulkCall | ServedCall) -> None:
        calls: dict[int, Any] = self.outgoing if isinstance(call, BulkCall) else self.incoming
        if call.number and calls.pop(call.number, None) is not None and not self.busy():
            self.idle_since = time.monotonic()

    async def _read(self) -> None:
        try:
            while True:
                kind, number, payload = await asyncio.wait_for(read_frame(self.reader), IDLE_S)
                if kind == Kind.HELLO or number == 0:
                    raise FrameError(f"a {kind.name} frame for call {number} after the hello")
                if self.mine(number):
                    self._answer_frame(kind, number, payload)
                else:
                    self._call_frame(kind, number, payload)
        except asyncio.CancelledError:
            self.broken = ConnectionError("the bulk connection was closed")
        except Exception as exc:  # noqa: BLE001 - the link is gone, with every call on it
            logger.debug("bulk link with %s broken: %s: %s", self.peer, type(exc).__name__, exc)
            self.broken = exc
        assert self.broken is not None
        self.writer.close()
        for call in list(self.outgoing.values()):
            call.fail(self.broken)
        served = [call.task for call in self.incoming.values()]
        for task in served:
            task.cancel()
        await asyncio.gather(*served, return_exceptions=True)
        if self.on_close is not None:
            self.on_close(self)

    def _answer_frame(self, kind: Kind, number: int, payload: bytes | bytearray) -> None:
        """A frame of one of this end's calls: an answer, its end, or credit for more parts."""
        if kind == Kind.CLOSE or number >= self.next:
            raise FrameError(f"the other end sent a {kind.name} frame for call {number}, which this end never made")
        call = self.outgoing.get(number)
        if call is None:  # a call this end gave up: whatever the other end sent is dropped
            if kind == Kind.CREDIT:
                read_count(payload)
            return
        if kind == Kind.DATA:
            call.receive(payload)
        elif kind == Kind.END:
            call.end()
        else:
            call.credit.grant(read_count(payload))

    def _call_frame(self, kind: Kind, number: int, payload: bytes | bytearray) -> None:
        """A frame of one of the other end's calls: its first part opens it."""
        if number > self.last_in:
            if kind != Kind.DATA:
                raise FrameError(f"call {number} began with a {kind.name} frame")
            if self.handler is None:
                raise FrameError("a call to an end that answers none")
            if len(self.incoming) >= MAX_CALLS:
                raise FrameError(f"more than {MAX_CALLS} calls open at once")
            self.last_in = number
            self.incoming[number] = ServedCall(self, number, self.handler)
        call = self.incoming.get(number)
        if call is None:
            if kind == Kind.CREDIT:
                read_count(payload)
            return  # a finished call: what the other end sent before it knew is dropped
        if kind == Kind.DATA:
            call.receive(payload)
        elif kind == Kind.END:
            call.end()
        elif kind == Kind.CLOSE:
            call.close()
        else:
            call.credit.grant(read_count(payload))


class BulkCall:
    """This end's call: sends ``requests`` as ``DATA`` frames (then ``END``) while the averaged
    parts are read back; the async iterator hivemind's stub would return, with ``aclose``."""

    def __init__(self, link: BulkLink, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        self.link = link
        self.number = 0
        """Given with the first part (``BulkLink.number``); 0 before."""
        self.queue: asyncio.Queue[bytes | bytearray | None | BaseException] = asyncio.Queue()
        self.unread = WINDOW
        """Averaged parts the other end may still send before this end credits more."""
        self.credit = Credit()
        """Parts this end may still send."""
        self._end_read = False
        """The other end's ``END`` arrived (it may still wait in the queue)."""
        self._ended = False
        """The other end's ``END`` was read: it has forgotten this call."""
        self._closed = False
        self._sender = asyncio.create_task(self._send(requests))

    async def _send(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        writer = self.link.writer
        try:
            async for message in requests:
                await self.credit.take()
                if not self.number:
                    self.number = self.link.number(self)
                write_frame(writer, Kind.DATA, message.SerializeToString(), self.number)
                await writer.drain()
            if not self.number:  # nothing to send: a call is never opened by its end
                self.end()
                return
            write_frame(writer, Kind.END, call=self.number)
            await writer.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader learns it; aclose tells the other end
            self.queue.put_nowait(ConnectionError(f"bulk call failed sending: {type(exc).__name__}: {exc}"))

    def receive(self, payload: bytes | bytearray) -> None:
        """An averaged part from the link's reader; ``FrameError`` (the link breaks) for one past
        this call's credit or after its ``END``."""
        if self._end_read or self.unread <= 0:
            raise FrameError(f"the other end sent call {self.number} a part past its credit or its END")
        self.unread -= 1
        self.queue.put_nowait(payload)

    def end(self) -> None:
        if self._end_read:
            raise FrameError(f"a second END in call {self.number}")
        self._end_read = True
        self.queue.put_nowait(None)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

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
        if not self.link.writer.is_closing():
            write_credit(self.link.writer, self.number)
        message = averaging_pb2.AveragingData()
        message.ParseFromString(item)
        return message

    async def aclose(self) -> None:
        """End the call: parts not yet sent are not, and the other end, if still serving it, is
        told to stop (``CLOSE``); the link stays for other calls and the next round."""
        if self._closed:
            return
        self._closed = True
        link = self.link
        link.forget(self)
        if not self._sender.done() and link.broken is None:
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._sender), WRAP_UP_S)
        self._sender.cancel()
        await asyncio.gather(self._sender, return_exceptions=True)
        if self.number and not self._end_read and not link.writer.is_closing():
            write_frame(link.writer, Kind.CLOSE, call=self.number)


class ServedCall:
    """The other end's call: its parts in, the handler's answers out."""

    def __init__(self, link: BulkLink, number: int, handler: Handler) -> None:
        self.link, self.number, self.handler = link, number, handler
        self.queue: asyncio.Queue[bytes | bytearray | None] = asyncio.Queue()
        self.unread = WINDOW
        """Parts the other end may still send before this end credits more."""
        self.ended = False
        self.credit = Credit()
        """Averaged parts this end may still send back."""
        self.task = asyncio.create_task(self._answer())

    def receive(self, payload: bytes | bytearray) -> None:
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
        """The caller closed the call: a handler still waiting is cancelled."""
        self.link.forget(self)
        self.task.cancel()

    async def _answer(self) -> None:
        link = self.link
        writer = link.writer
        answers = self.handler(self._requests(), link.context)
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
            return  # closed by the caller, or the link is gone
        except (ConnectionError, DecodeError) as exc:
            logger.debug("bulk call %d from %s failed: %s", self.number, link.peer, exc)
        except Exception as exc:  # noqa: BLE001 - the handler refused the call (e.g. not a member)
            logger.info("bulk call from %s failed: %s: %s", link.peer, type(exc).__name__, exc)
        if self.number in link.incoming:
            link.forget(self)
            write_frame(writer, Kind.END, call=self.number)
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    async def _requests(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        while (item := await self.queue.get()) is not None:
            self.unread += 1
            if not self.link.writer.is_closing():
                write_credit(self.link.writer, self.number)
            message = averaging_pb2.AveragingData()
            message.ParseFromString(item)
            yield message
