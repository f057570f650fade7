"""Round reports on their way to the coordinator, kept on disk until it answers.

A peer's credit for a round comes from its report; a report held only in memory dies with a
killed peer (a spot instance reclaimed, an OOM, a laptop lid), and a pair whose other member
then reports alone is credited for nothing (one member's say-so credits nobody). So a report is
written under the peer's checkpoint directory (``reports/``) *before* anything tries to send it,
atomically (a temporary file, fsync, rename: a crash leaves the report whole or not at all), and
deleted once the coordinator answered it (took it, or refused it for good). A peer started again
with the same directory (its node key, which signs reports, lives there too) sends what it left,
oldest first, as soon as it is admitted; the coordinator decides a round a minute after its
first report and takes a resent report once (``Coordinator.report_round``: "already reported").

Without a directory the outbox lives in memory only. Either way it holds at most
``MAX_PENDING`` reports (a coordinator away for hours): the oldest go first, logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from pathlib import Path

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb

__all__ = ["MAX_PENDING", "OUTBOX_DIR", "ReportOutbox"]

logger = logging.getLogger(__name__)

OUTBOX_DIR = "reports"
"""The outbox's folder under ``--checkpoint-dir``."""
MAX_PENDING = 1024
"""At most this many reports wait (each a few hundred bytes plus ~80 a group member)."""
_SUFFIX = ".pb"
_UNREADABLE = ".unreadable"


class ReportOutbox:
    """Reports not answered yet, oldest first (thread-safe: the trainer puts, the link sends)."""

    def __init__(self, where: Path | None = None) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._pending: deque[tuple[pb.RoundReportBody, Path | None]] = deque()
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
            self._load(where)

    def _load(self, where: Path) -> None:
        """Take up the reports a previous run of this peer left (a write it did not finish is
        no report: its temporary file goes; a file that does not parse is set aside, named)."""
        for leftover in where.glob(f"*{_SUFFIX}.tmp"):
            leftover.unlink(missing_ok=True)
        for path in sorted(where.glob(f"*{_SUFFIX}")):
            body = pb.RoundReportBody()
            try:
                body.ParseFromString(path.read_bytes())
            except (DecodeError, OSError) as exc:
                aside = path.with_suffix(_UNREADABLE)
                logger.warning("report outbox: %s does not parse (%s); set aside as %s", path, exc, aside.name)
                path.replace(aside)
                continue
            self._pending.append((body, path))
        self._trim()
        if self._pending:
            rounds = [body.round for body, _ in self._pending]
            logger.info(
                "report outbox: %d reports of an earlier run to send (rounds %d-%d)", len(rounds), rounds[0], rounds[-1]
            )

    def put(self, body: pb.RoundReportBody) -> None:
        """Keep ``body`` (on disk first, when the outbox has a directory) until ``done``."""
        path = None
        if self.where is not None:
            path = self.where / f"{body.round:012d}{_SUFFIX}"
            temporary = path.with_name(path.name + ".tmp")
            with temporary.open("wb") as handle:
                handle.write(body.SerializeToString())
                handle.flush()
                os.fsync(handle.fileno())
            temporary.replace(path)
            directory = os.open(self.where, os.O_RDONLY)
            try:  # the rename itself survives a power cut
                os.fsync(directory)
            finally:
                os.close(directory)
        with self._lock:
            self._pending.append((body, path))
            self._trim()

    def first(self) -> pb.RoundReportBody | None:
        """The oldest report waiting, or None."""
        with self._lock:
            return self._pending[0][0] if self._pending else None

    def done(self, body: pb.RoundReportBody) -> None:
        """The coordinator answered ``body`` (the report ``first`` gave): it goes."""
        with self._lock:
            if not self._pending or self._pending[0][0] is not body:
                return
            _, path = self._pending.popleft()
        if path is not None:
            path.unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def _trim(self) -> None:
        while len(self._pending) > MAX_PENDING:
            body, path = self._pending.popleft()
            logger.warning("report outbox: more than %d reports waiting; dropped round %d's", MAX_PENDING, body.round)
            if path is not None:
                path.unlink(missing_ok=True)
