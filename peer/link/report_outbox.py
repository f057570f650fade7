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

A report is whole only once its round's state is hashed, at the end of the landing; a peer
killed between its group's all-reduce and that moment (the landing is the longest stretch of a
round's host work) would leave its partners with a member that never reports, and a pair with
one witness credits nobody. So when the all-reduce returns, the report without its digest is
kept too (``start``: ``NNN.landing``). The landed round's report replaces it (``put``); a peer
started again that comes to hold that round's state (its checkpoint resumed, the swarm's
state adopted, or rolled forward through on the way to it, digests verified against the swarm's
records) finishes it with that digest and
sends it (``holds``): its group landed exactly that state with its contribution in it, and the
report says no more than that. The unfinished report keeps the digest of the state the round
started from (``pre``): a peer that comes to hold a later round first asks a member for that
round's update, which names the state it made (``Adoption._finish_reports``), and finishes the
report with it (a server that lies about it costs only this report's credit: the coordinator
grants a claim only with the digest its group's reports name). One that cannot goes, logged.

Without a directory the outbox lives in memory only. Either way it holds at most
``MAX_PENDING`` reports (a coordinator away for hours): the oldest go first, logged.
"""

from __future__ import annotations

import base64
import binascii
import json
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
_UNFINISHED = ".landing"
_UNREADABLE = ".unreadable"


class ReportOutbox:
    """Reports not answered yet, oldest first (thread-safe: the trainer puts, the link sends)."""

    def __init__(self, where: Path | None = None) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._pending: deque[tuple[pb.RoundReportBody, Path | None]] = deque()
        self._unfinished: dict[int, tuple[pb.RoundReportBody, str, Path | None]] = {}
        """Reports of rounds whose landing had not finished, by round (no digest yet), with the
        digest of the state each round started from."""
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
            self._load(where)

    def _load(self, where: Path) -> None:
        """Take up the reports a previous run of this peer left (a write it did not finish is
        no report: its temporary file goes; a file that does not parse is set aside, named)."""
        for leftover in where.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        for path in sorted(where.glob(f"*{_SUFFIX}")):
            if (body := _read(path)) is not None:
                self._pending.append((body, path))
        for path in sorted(where.glob(f"*{_UNFINISHED}")):
            if (unfinished := _read_unfinished(path)) is not None:
                body, pre = unfinished
                self._unfinished[body.round] = (body, pre, path)
        self._trim()
        if self._unfinished:
            logger.info(
                "report outbox: rounds %s were landing when this peer stopped; their reports go once it holds "
                "that round's state",
                sorted(self._unfinished),
            )
        if self._pending:
            rounds = [body.round for body, _ in self._pending]
            logger.info(
                "report outbox: %d reports of an earlier run to send (rounds %d-%d)", len(rounds), rounds[0], rounds[-1]
            )

    def put(self, body: pb.RoundReportBody) -> None:
        """Keep ``body`` (on disk first, when the outbox has a directory) until ``done``; it
        replaces the unfinished report of its round (and any older one: never to be finished)."""
        path = self._write(body, _SUFFIX)
        with self._lock:
            self._pending.append((body, path))
            self._trim()
            gone = [self._unfinished.pop(r) for r in sorted(self._unfinished) if r <= body.round]
        for _, _, unfinished in gone:
            if unfinished is not None:
                unfinished.unlink(missing_ok=True)

    def start(self, body: pb.RoundReportBody, pre: str) -> None:
        """Keep the report of a round whose landing begins (``body`` without its digest; ``pre``:
        the digest of the state the round started from) until the landed round's report
        replaces it (``put``) or a restarted peer finishes it (``holds``)."""
        record = {"pre": pre, "body": base64.b64encode(body.SerializeToString()).decode()}
        path = self._write_bytes(body.round, json.dumps(record).encode(), _UNFINISHED)
        with self._lock:
            self._unfinished[body.round] = (body, pre, path)

    def holds(self, round_: int, digest: str) -> bool:
        """This peer holds the state of ``round_`` (digest ``digest``, its own or verified against
        the swarm's records): finish that round's unfinished report with it and send it; drop the
        unfinished reports of earlier rounds (they can no longer be finished). True if one was."""
        with self._lock:
            gone = [(r, *self._unfinished.pop(r)) for r in sorted(self._unfinished) if r <= round_]
        finished = False
        for number, body, _pre, path in gone:
            if number == round_ and digest:
                body.state_digest = digest
                self.put(body)
                finished = True
                logger.info(
                    "report outbox: finished the report of round %d, which this peer was landing when it stopped",
                    number,
                )
            else:
                logger.info(
                    "report outbox: the report of round %d cannot be finished (this peer holds round %d)",
                    number,
                    round_,
                )
            if path is not None:
                path.unlink(missing_ok=True)
        return finished

    def unfinished(self) -> list[tuple[int, str]]:
        """The rounds whose reports wait for their digest, oldest first, each with the digest of
        the state it started from."""
        with self._lock:
            return [(r, self._unfinished[r][1]) for r in sorted(self._unfinished)]

    def _write(self, body: pb.RoundReportBody, suffix: str) -> Path | None:
        """Write ``body`` atomically under the outbox's folder (None without one)."""
        return self._write_bytes(body.round, body.SerializeToString(), suffix)

    def _write_bytes(self, round_: int, data: bytes, suffix: str) -> Path | None:
        if self.where is None:
            return None
        path = self.where / f"{round_:012d}{suffix}"
        temporary = path.with_name(path.name + ".tmp")
        with temporary.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(path)
        directory = os.open(self.where, os.O_RDONLY)
        try:  # the rename itself survives a power cut
            os.fsync(directory)
        finally:
            os.close(directory)
        return path

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


def _read_unfinished(path: Path) -> tuple[pb.RoundReportBody, str] | None:
    """The unfinished report in ``path`` and its round's starting digest, or None if it does not
    parse (then set aside, named)."""
    body = pb.RoundReportBody()
    try:
        record = json.loads(path.read_bytes())
        body.ParseFromString(base64.b64decode(record["body"], validate=True))
        pre = record["pre"]
        if not isinstance(pre, str):
            raise ValueError("its starting digest is no string")
    except (DecodeError, OSError, ValueError, KeyError, TypeError, binascii.Error) as exc:
        aside = path.with_suffix(_UNREADABLE)
        logger.warning("report outbox: %s does not parse (%s); set aside as %s", path, exc, aside.name)
        path.replace(aside)
        return None
    return body, pre


def _read(path: Path) -> pb.RoundReportBody | None:
    """The report in ``path``, or None if it does not parse (then set aside, named)."""
    body = pb.RoundReportBody()
    try:
        body.ParseFromString(path.read_bytes())
    except (DecodeError, OSError) as exc:
        aside = path.with_suffix(_UNREADABLE)
        logger.warning("report outbox: %s does not parse (%s); set aside as %s", path, exc, aside.name)
        path.replace(aside)
        return None
    return body
