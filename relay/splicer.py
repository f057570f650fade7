"""Splices off the training process: ``Splicer.pipe_both`` hands two connected asyncio streams to
a process of their own (``relay.splice_worker``) and waits until it has carried both directions
to their end, as ``relay.wire.pipe_both`` does in the caller's own loop.

Why: a relay tunnel, a punched connection and a volunteer's relay copy libp2p's bytes on asyncio
loops of the peer's process, beside the trainer. Every chunk they copy needs the interpreter, and
a busy Python thread holds it for its switch interval (5 ms) at a time: beside one, a splice on
loopback carried 34 Mbit/s. In a process of their own the copy never waits for the trainer.

A hand-over: reading stops on both streams; what their readers had buffered (``StreamReader``'s
private ``_buffer``: no public call takes it without letting the reader resume its transport) is
written to the other side and flushed (it is part of the splice, counted); then each socket is duplicated and the
duplicate sent to the splice process (``SCM_RIGHTS``), and this side's transports are closed
(closing a descriptor does not end a connection another process holds). The splice process
reports the bytes carried every second and at the end (into ``counts``, as ``pipe_both`` does).

One splice process per ``Splicer``, started at the first splice and again if it died (splices it
carried then end: their connections break, as they would with the process that made them).
Cancelling ``pipe_both`` stops its splice.

A process shares one (``share``): a peer does at start, and then every splice it makes (its relay
tunnels', its punched connections', its relay's for others) goes through ``splice``, which
without a shared one copies in the caller's loop (``relay.wire.pipe_both``: the coordinator's
relay, which has no trainer beside it).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from relay.splice_worker import DONE, ORDER, REPORT
from relay.wire import pipe_both

__all__ = ["Splicer", "share", "splice"]

logger = logging.getLogger(__name__)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
STOP_WAIT_S = 5.0


class _Waiting:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None], counts: Any, base: tuple[int, int]
    ) -> None:
        self.loop, self.done, self.counts, self.base = loop, done, counts, base


class Splicer:
    """A process that carries splices for this one (thread-safe: any loop may hand it streams)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._waiting: dict[int, _Waiting] = {}
        self._ids = itertools.count(1)
        self.started = 0
        """Splice processes started (for tests: one, unless it died)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def pipe_both(self, a: Stream, b: Stream, counts: tuple[list[int], list[int]]) -> None:
        """Carry ``a`` ↔ ``b`` in the splice process until both directions end; ``counts``: bytes
        a→b, bytes b→a (added to, as the splice goes). A connection that breaks on the way (or
        a splice process that cannot start) ends it, as a broken connection ends ``pipe_both``."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        splice_id = 0
        try:
            first = await _hand_over(a, b)
            counts[0][0] += first[0]
            counts[1][0] += first[1]
            fds = [os.dup(_socket(stream).fileno()) for stream in (a, b)]
            try:
                with self._lock:
                    control = self._running()
                    splice_id = next(self._ids)
                    self._waiting[splice_id] = _Waiting(loop, done, counts, (counts[0][0], counts[1][0]))
                    control.sendmsg(
                        [ORDER.pack(splice_id)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    )
            finally:
                for fd in fds:
                    os.close(fd)
        except (ConnectionError, OSError) as exc:
            logger.info("splice not handed over: %s", exc)
            with self._lock:
                self._waiting.pop(splice_id, None)
            return
        finally:
            for _, writer in (a, b):
                writer.transport.abort()  # this side's descriptors only: the connections go on there
        try:
            await done
        except ConnectionError as exc:
            logger.info("splice ended: %s", exc)
        except asyncio.CancelledError:
            with self._lock, contextlib.suppress(OSError):
                if self._control is not None:
                    self._control.send(ORDER.pack(splice_id))  # no sockets: stop it
            raise

    def close(self) -> None:
        """End the splice process (its splices end with it) and wait for it."""
        with self._lock:
            control, process = self._control, self._process
            self._control = self._process = None
        if control is not None:
            control.close()
        if process is not None:
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _running(self) -> socket.socket:
        """The control socket of a live splice process, started if needed (under the lock)."""
        if self._control is not None and self._process is not None and self._process.poll() is None:
            return self._control
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        flags = ["-P"] if sys.flags.safe_path else []  # the same code as this process, not the cwd's
        try:
            self._process = subprocess.Popen(
                [sys.executable, *flags, "-m", "relay.splice_worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._control = ours
        self.started += 1
        threading.Thread(target=self._reports, args=(ours,), daemon=True, name="splicer-reports").start()
        return ours

    def _reports(self, control: socket.socket) -> None:
        """The splice process's reports, until it or ``control`` closes: counts, and the end."""
        while True:
            try:
                report = control.recv(REPORT.size)
            except OSError:
                report = b""
            if len(report) != REPORT.size:
                break
            splice_id, kind, forward, back = REPORT.unpack(report)
            with self._lock:
                waiting = self._waiting.get(splice_id) if kind != DONE else self._waiting.pop(splice_id, None)
            if waiting is None:
                continue
            waiting.counts[0][0] = waiting.base[0] + forward
            waiting.counts[1][0] = waiting.base[1] + back
            if kind == DONE:
                waiting.loop.call_soon_threadsafe(_settle, waiting.done, None)
        # the process is gone: its splices ended with it
        with self._lock:
            if self._control is control:
                self._control = None
            lost = [w for w in self._waiting.values()]
            self._waiting.clear()
        for waiting in lost:
            waiting.loop.call_soon_threadsafe(_settle, waiting.done, ConnectionError("the splice process ended"))


_shared: Splicer | None = None


def share(splicer: Splicer | None) -> None:
    """Make ``splicer`` carry this process's splices (None: each in its caller's loop again)."""
    global _shared
    _shared = splicer


async def splice(a: Stream, b: Stream, counts: tuple[list[int], list[int]]) -> None:
    """``a`` ↔ ``b`` until both directions end: in the shared splice process if there is one."""
    splicer = _shared
    if splicer is None:
        await pipe_both(a, b, counts)
    else:
        await splicer.pipe_both(a, b, counts)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _socket(stream: Stream) -> socket.socket:
    sock = stream[1].get_extra_info("socket")
    if sock is None:
        raise ConnectionError("this stream has no socket to hand over")
    return sock


async def _hand_over(a: Stream, b: Stream) -> tuple[int, int]:
    """Stop reading ``a`` and ``b``; write what each had buffered to the other and flush both.
    Returns the bytes so moved a→b and b→a."""
    for _, writer in (a, b):
        transport: Any = writer.transport  # a socket transport (asyncio's or uvloop's)
        transport.pause_reading()
    await asyncio.sleep(0)  # a read already queued in this loop's turn lands in the buffer now
    pending = []
    for reader, _ in (a, b):
        # what the reader holds, taken whole: reading it through the reader would let it resume
        # the transport (it does once its buffer drains below its limit)
        buffered: bytearray = reader._buffer  # type: ignore[attr-defined]
        pending.append(bytes(buffered))
        buffered.clear()
    for data, (_, writer) in zip(pending, (b, a)):
        writer.transport.set_write_buffer_limits(high=0)
        if data:
            writer.write(data)
    for _, writer in (b, a):
        await writer.drain()  # with a high-water mark of 0: until nothing is left to write
    return len(pending[0]), len(pending[1])
