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
from dataclasses import dataclass

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
    answer: Callable[[Outcome], None]


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
        done = threading.Event()
        outcomes: list[Outcome] = []

        def answer(outcome: Outcome) -> None:
            outcomes.append(outcome)
            done.set()

        self.submit_async(report, answer)
        if not done.wait(ANSWER_TIMEOUT_S):
            raise ReportsBusyError(f"the report was not recorded within {ANSWER_TIMEOUT_S:.0f} s: send it again later")
        if isinstance(outcomes[0], Exception):
            raise outcomes[0]
        return outcomes[0]

    def submit_async(self, report: Report, answer: Callable[[Outcome], None]) -> None:
        """Record ``report`` with the next batch; ``answer`` is called with its outcome once that
        batch is committed (on the writer's thread: it must not block), or at once when the
        writer is closed."""
        with self._wake:
            closed = self._closed
            if not closed:
                self._queue.append(_Waiting(report, answer))
                self._wake.notify()
        if closed:
            answer(ReportsBusyError("the coordinator is shutting down: send the report again later"))

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
                try:
                    waiting.answer(outcome)
                except Exception:
                    logger.exception("answering a report failed")

    def close(self) -> None:
        """Record what is queued, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
