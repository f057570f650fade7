"""The core's side of its heartbeat processes (``coordinator.front.process``): starts them,
keeps their tables current (``Heartbeats.drain``), applies the heartbeats they verified, and
starts one again, with the whole table, when it died (peers heartbeat to the main port
meanwhile: ``peer.link.coordinator_client``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from coordinator.front.process import FrontConfig
from coordinator.front.wire import FAILED, READY, STOP, Acked, Answer, Answers, Beats
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
ACK_TIMEOUT_S = 5.0
"""How long a join waits for the heartbeat processes to know the peer it admits."""


@dataclass
class _Process:
    process: subprocess.Popen[bytes]
    conn: Connection
    acked: int = 0
    reader: threading.Thread | None = None


class Fronts:
    """``count`` heartbeat processes on one port (see the module doc)."""

    def __init__(
        self,
        config: FrontConfig,
        count: int,
        *,
        apply: Callable[[Beats], object],
        drain: Callable[[], tuple[dict[str, Answer], tuple[str, ...]]],
        everyone: Callable[[], dict[str, Answer]],
    ) -> None:
        """``apply``: applies a batch of verified heartbeats (called from a reader thread);
        ``drain``: the answers changed and the keys dropped since it was last called
        (``Heartbeats.drain``); ``everyone``: every admitted key's answer (for a process started
        afresh)."""
        if count < 1:
            raise ValueError("at least one heartbeat process")
        self.config = replace(config, reuse_port=count > 1)
        self.count, self.apply, self.drain, self.everyone = count, apply, drain, everyone
        self.port = 0
        self._processes: list[_Process] = []
        self._seq = 0
        self._send_lock = threading.Lock()
        self._acked = threading.Condition()
        self._stopping = False

    def start(self) -> int:
        """Start every process; the port they share."""
        first = self._spawn(self.config)
        self.port = first[1]
        self._processes.append(first[0])
        config = replace(self.config, port=self.port)
        for _ in range(self.count - 1):
            self._processes.append(self._spawn(config)[0])
        return self.port

    def _spawn(self, config: FrontConfig) -> tuple[_Process, int]:
        # a process of its own started afresh (the coordinator runs threads: no fork), on one
        # end of a socket pair
        ours, theirs = socket.socketpair()
        command = [
            sys.executable,
            # the modules this process imported, not the working directory's (``python -P``)
            *(["-P"] if sys.flags.safe_path else []),
            "-m",
            "coordinator.front.process",
            "--fd",
            str(theirs.fileno()),
            "--config",
            json.dumps(dataclasses.asdict(config)),
        ]
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        parent = Connection(os.dup(ours.fileno()))
        ours.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            process.wait()
            raise ConfigError(f"the heartbeat process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            status, detail = parent.recv()
        except EOFError:
            raise ConfigError(f"the heartbeat process exited at start (code {process.wait()})") from None
        if status == FAILED:
            process.wait(timeout=10)
            raise ConfigError(str(detail))
        assert status == READY
        entry = _Process(process, parent)
        entry.reader = threading.Thread(target=self._read, args=(entry,), daemon=True, name="heartbeat-batches")
        entry.reader.start()
        return entry, int(detail)

    def _read(self, entry: _Process) -> None:
        while True:
            try:
                record = entry.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(record, Beats):
                try:
                    self.apply(record)
                except Exception:
                    logger.exception("applying a batch of heartbeats failed")
            elif isinstance(record, Acked):
                with self._acked:
                    entry.acked = max(entry.acked, record.seq)
                    self._acked.notify_all()

    def sync(self, *, wait: bool = False) -> None:
        """Send what changed (``drain``) to every process; with ``wait``, until each applied it
        (or ``ACK_TIMEOUT_S`` passed: a heartbeat meanwhile is told to join again). Drained and
        sent in one step, so that no process sees an older answer after a newer one."""
        with self._send_lock:
            answers, dropped = self.drain()
            if answers or dropped:
                self._seq += 1
                for entry in self._processes:
                    self._send(entry, Answers(self._seq, answers, dropped))
            seq = self._seq  # what another thread drained and sent may hold this join's peer: wait for it too
        if not wait or seq == 0:
            return
        deadline = time.monotonic() + ACK_TIMEOUT_S
        with self._acked:
            while any(e.acked < seq and e.process.poll() is None for e in self._processes):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("a heartbeat process did not take a join within %.0f s", ACK_TIMEOUT_S)
                    return
                self._acked.wait(left)

    @staticmethod
    def _send(entry: _Process, record: object) -> None:
        try:
            entry.conn.send(record)
        except (OSError, ValueError) as exc:  # it died: ``mend`` starts another
            logger.debug("heartbeat process unreachable: %s", exc)

    def mend(self) -> int:
        """Start again each process that died (with the whole table); how many were."""
        mended = 0
        with self._send_lock:  # no update goes to a dead process meanwhile, nor a start after ``stop``
            for index, entry in enumerate(self._processes):
                if self._stopping or entry.process.poll() is None:
                    continue
                logger.error(
                    "heartbeat process %d exited (code %s): starting another",
                    entry.process.pid,
                    entry.process.returncode,
                )
                entry.conn.close()
                fresh, _ = self._spawn(replace(self.config, port=self.port))
                self._send(fresh, Answers(self._seq, self.everyone(), ()))
                self._processes[index] = fresh
                mended += 1
        return mended

    def pids(self) -> list[int]:
        return [int(e.process.pid) for e in self._processes]

    def stop(self) -> None:
        with self._send_lock:
            self._stopping = True
            for entry in self._processes:
                self._send(entry, STOP)
        for entry in self._processes:
            try:
                entry.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                entry.process.kill()
                entry.process.wait(timeout=5)
            entry.conn.close()
