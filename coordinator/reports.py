"""Round reports recorded many per transaction: a swarm's reports come in a burst at each
round's end (every group finishes within seconds), and one durable commit per report (an fsync
each on SQLite, a round trip each on PostgreSQL, under the core's lock) capped a coordinator at
a few hundred reports a second, so that 10,000 peers' reports of one round took most of a minute.

``ReportWriter`` takes reports already verified (signature, age, replay, bounds, admitted: the
servicer does that outside the core's lock, ``Coordinator.verify_report``), and one thread
records them in batches under the core's lock (``Coordinator.record_reports``: the checks that
read the round book, then one transaction, then the book's memory). Each report is answered once
its batch is committed, so an answered report survives a crash as before. A batch holds at most
one report per peer (a peer's second report waits for the next batch: its claim's time bound
starts where the first one's ends). Batches form by themselves: while one commits, the next
fills, so a quiet coordinator writes each report at once and a busy one many per commit.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import coordinator_pb2 as pb
from protocol.errors import SwarmtrainError

logger = logging.getLogger(__name__)

MAX_BATCH = 512
"""Reports per transaction at most."""
ANSWER_TIMEOUT_S = 120.0
"""A report not recorded within this is answered UNAVAILABLE (the peer sends it again later)."""

Report = tuple[str, pb.RoundReportBody, float]
"""A verified report: its signer's key, body and arrival time."""
Outcome = pb.RoundReportResponse | Exception


class ReportsBusyError(SwarmtrainError):
    """A report waited longer than ``ANSWER_TIMEOUT_S`` for its batch."""


@dataclass
class _Waiting:
    report: Report
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None


class ReportWriter:
    """One thread that records verified reports in batches (see the module doc)."""

    def __init__(
        self,
        record: Callable[[list[Report]], list[Outcome]],
        lock: threading.Lock,
        *,
        max_batch: int = MAX_BATCH,
    ) -> None:
        """``record``: records a batch (distinct keys) and answers each report, or says the
        error that refuses it; called holding ``lock`` (the core's)."""
        self.record, self.lock, self.max_batch = record, lock, max_batch
        self._queue: deque[_Waiting] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.batches = 0
        self.recorded = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="report-writer")
        self._thread.start()

    def submit(self, report: Report) -> pb.RoundReportResponse:
        """Record ``report`` with the next batch and answer it once that batch is committed;
        raises the error that refuses it."""
        waiting = _Waiting(report)
        with self._wake:
            if self._closed:
                raise ReportsBusyError("the coordinator is shutting down: send the report again later")
            self._queue.append(waiting)
            self._wake.notify()
        if not waiting.done.wait(ANSWER_TIMEOUT_S):
            raise ReportsBusyError(f"the report was not recorded within {ANSWER_TIMEOUT_S:.0f} s: send it again later")
        assert waiting.outcome is not None
        if isinstance(waiting.outcome, Exception):
            raise waiting.outcome
        return waiting.outcome

    def _next_batch(self) -> list[_Waiting] | None:
        with self._wake:
            while not self._queue and not self._closed:
                self._wake.wait()
            if not self._queue:
                return None
            batch: list[_Waiting] = []
            later: list[_Waiting] = []
            keys: set[str] = set()
            while self._queue and len(batch) < self.max_batch:
                waiting = self._queue.popleft()
                (later if waiting.report[0] in keys else batch).append(waiting)
                keys.add(waiting.report[0])
            self._queue.extendleft(reversed(later))
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                with self.lock:
                    outcomes: list[Outcome] = self.record([w.report for w in batch])
            except Exception as exc:  # the database is away, say: every report of the batch is told
                logger.exception("recording %d report(s) failed", len(batch))
                outcomes = [exc] * len(batch)
            self.batches += 1
            self.recorded += len(batch)
            for waiting, outcome in zip(batch, outcomes, strict=True):
                waiting.outcome = outcome
                waiting.done.set()

    def close(self) -> None:
        """Record what is queued, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
