"""The splice process (``relay.splicer``): copies bytes between pairs of sockets handed to it,
away from the interpreter of the process that made the connections.

Run as ``python -m relay.splice_worker FD``, FD one end of a ``SOCK_SEQPACKET`` socket pair. Each
packet from the parent is a splice id (8 bytes) with two sockets attached (``SCM_RIGHTS``): copy
each to the other until both directions end (each half-closes the other's write side at its
end), then close both. A packet with an id and no sockets stops that splice. This process sends
``(id, 0, a→b, b→a)`` every ``PROGRESS_S`` for each running splice and ``(id, 1, a→b, b→a)`` when
one ends. It exits when the parent's end closes (the parent exited or closed it), closing every
socket it holds.

Each direction is a thread doing blocking ``recv_into`` and ``sendall`` on a buffer of its own:
both release the interpreter for the system call, and nothing else runs here to hold it.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import sys
import threading

__all__ = ["DONE", "PROGRESS", "REPORT", "main"]

BUFFER_BYTES = 256 * 1024
PROGRESS_S = 1.0
PROGRESS, DONE = 0, 1
REPORT = struct.Struct(">QBQQ")
"""What this process sends the parent: splice id, PROGRESS or DONE, bytes a→b, bytes b→a."""
ORDER = struct.Struct(">Q")


class _Splice:
    def __init__(self, splice_id: int, a: socket.socket, b: socket.socket, report: _Reporter) -> None:
        self.id, self.a, self.b, self.report = splice_id, a, b, report
        self.counts = [0, 0]
        self._left = 2
        self._lock = threading.Lock()
        for sock in (a, b):
            sock.setblocking(True)

    def start(self) -> None:
        """Copy both ways (once the splice is registered: a direction may end at once)."""
        for index, (source, sink) in enumerate(((self.a, self.b), (self.b, self.a))):
            threading.Thread(
                target=self._copy, args=(index, source, sink), daemon=True, name=f"splice-{self.id}"
            ).start()

    def _copy(self, index: int, source: socket.socket, sink: socket.socket) -> None:
        buffer = bytearray(BUFFER_BYTES)
        view = memoryview(buffer)
        try:
            while received := source.recv_into(buffer):
                sink.sendall(view[:received])
                self.counts[index] += received
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            self.stop()  # one side broke: both go
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.report.done(self)

    def stop(self) -> None:
        for sock in (self.a, self.b):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for sock in (self.a, self.b):
            sock.close()


class _Reporter:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.splices: dict[int, _Splice] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self._progress, daemon=True, name="splice-progress").start()

    def send(self, splice: _Splice, kind: int) -> None:
        try:
            self.control.send(REPORT.pack(splice.id, kind, splice.counts[0], splice.counts[1]))
        except OSError:
            self.stopped.set()

    def done(self, splice: _Splice) -> None:
        with self.lock:
            self.splices.pop(splice.id, None)
            self.send(splice, DONE)
        splice.close()

    def _progress(self) -> None:
        while not self.stopped.wait(PROGRESS_S):
            with self.lock:
                for splice in list(self.splices.values()):
                    self.send(splice, PROGRESS)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(args[0]))
    reporter = _Reporter(control)
    fd_space = socket.CMSG_SPACE(2 * array.array("i").itemsize)
    try:
        while True:
            message, ancillary, _flags, _addr = control.recvmsg(ORDER.size, fd_space)
            if not message:
                break  # the parent is gone
            fds: list[int] = []
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % array.array("i").itemsize
                    fds.extend(array.array("i", data[:usable]))
            (splice_id,) = ORDER.unpack(message)
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                with reporter.lock:
                    stopping = reporter.splices.get(splice_id)
                if stopping is not None:
                    stopping.stop()
                continue
            a, b = (socket.socket(fileno=fd) for fd in fds)
            splice = _Splice(splice_id, a, b, reporter)
            with reporter.lock:
                reporter.splices[splice_id] = splice
            splice.start()
    finally:
        reporter.stopped.set()
        with reporter.lock:
            for splice in reporter.splices.values():
                splice.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
