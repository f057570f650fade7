"""Round reports recorded many per transaction (``coordinator.reports``): each answered once its
batch is committed, one report per peer in a batch, a refused one changing nothing of the
others, and a batch the database refuses leaving nothing behind."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.exc import OperationalError

from coordinator.core import Coordinator
from coordinator.reports import ReportWriter
from coordinator.store import NewClaim
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.unit.claim_calls import group, join


def verified(core: Coordinator, peer: Identity, now: float, **fields: object) -> tuple[str, pb.RoundReportBody, float]:
    fields = {"state_digest": "blake3:ab", "group": group([peer], 8)} | fields
    body = pb.RoundReportBody(**fields)  # type: ignore[arg-type]
    envelope = sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=now).to_proto()
    key, checked = core.verify_report(envelope, now=now)
    return key.id, checked, now


class CountingCommits:
    def __init__(self, core: Coordinator) -> None:
        self.batches: list[int] = []
        inner = core.store.record_claims

        def record(claims: list[NewClaim]) -> set[tuple[str, int]]:
            self.batches.append(len(claims))
            time.sleep(0.02)  # a commit's fsync: the next batch fills meanwhile
            return inner(claims)

        core.store.record_claims = record  # type: ignore[method-assign]


def test_a_burst_of_reports_is_recorded_in_few_transactions_and_each_answered(core: Coordinator) -> None:
    now = time.time() - 60
    peers = [join(core, now) for _ in range(64)]
    commits = CountingCommits(core)
    writer = ReportWriter(core.record_reports, threading.Lock())
    try:
        reports = [verified(core, p, time.time(), round=1, samples=8) for p in peers]
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(writer.submit, reports))
    finally:
        writer.close()
    assert all("pending" in a.reason for a in answers)
    assert sum(commits.batches) == 64 and len(commits.batches) < 32
    assert {c.key for c in core.store.claims(round=1)} == {p.public_key.id for p in peers}
    assert all(core.rounds.already_reported(p.public_key.id, 1) for p in peers)


def test_a_batch_holds_one_report_per_peer(core: Coordinator) -> None:
    """A peer's reports of two rounds sent together go in two batches: the second claim's time
    bound starts where the first one's duration ends, as when they arrive one after another."""
    now = time.time()
    peer = join(core, now - 100)
    seen: list[list[str]] = []

    def record(reports: list) -> list:
        seen.append([key for key, _, _ in reports])
        return core.record_reports(reports)

    writer = ReportWriter(record, threading.Lock())
    try:
        first = verified(core, peer, now, round=1, samples=8, compute_s=60.0)
        second = verified(core, peer, now, round=2, samples=8, compute_s=60.0)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(writer.submit, [first, second]))
    finally:
        writer.close()
    assert all("pending" in a.reason for a in answers)
    assert all(len(set(keys)) == len(keys) for keys in seen) and len(seen) == 2
    durations = sorted(c.duration_s for c in core.store.claims(key=peer.public_key.id))
    assert durations == pytest.approx([40.0, 60.0], abs=1)  # 100 s seen: 60 for the first, the rest for the second


def test_a_refused_report_changes_nothing_of_its_batch(core: Coordinator) -> None:
    now = time.time()
    good, bad, again = join(core, now - 60), join(core, now - 60), join(core, now - 60)
    core.record_reports([verified(core, again, now, round=1, samples=8)])
    outcomes = core.record_reports(
        [
            verified(core, good, now, round=1, samples=8),
            verified(core, bad, now, round=1, samples=8, state_digest=""),  # refused by the ledger
            verified(core, again, now, round=1, samples=8),  # already reported
        ]
    )
    assert "pending" in outcomes[0].reason  # type: ignore[union-attr]
    assert isinstance(outcomes[1], ValueError)
    assert outcomes[2].reason == "already reported"  # type: ignore[union-attr]
    assert {c.key for c in core.store.claims(round=1)} == {good.public_key.id, again.public_key.id}


def test_a_batch_the_database_refuses_leaves_nothing_behind(core: Coordinator) -> None:
    now = time.time()
    peers = [join(core, now - 60) for _ in range(3)]

    def down(claims: list[NewClaim]) -> set[tuple[str, int]]:
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    core.store.record_claims = down  # type: ignore[method-assign]
    writer = ReportWriter(core.record_reports, threading.Lock())
    try:
        for peer in peers:
            with pytest.raises(OperationalError):
                writer.submit(verified(core, peer, now, round=1, samples=8))
    finally:
        writer.close()
    assert not any(core.rounds.already_reported(p.public_key.id, 1) for p in peers)
    assert core.credit.take_changed() == set()


def test_the_store_records_each_key_and_round_once(core: Coordinator) -> None:
    def claim(key: str, round_: int) -> NewClaim:
        return NewClaim(key, round_, 8, "[]", "d", 1.0, 1.0)

    assert core.store.record_claims([claim("a", 1), claim("b", 1), claim("a", 1)]) == {("a", 1), ("b", 1)}
    assert core.store.record_claims([claim("a", 1), claim("a", 2), claim("c", 1)]) == {("a", 2), ("c", 1)}
    assert core.store.record_claims([]) == set()
    assert sorted((c.key, c.round) for c in core.store.claims()) == [("a", 1), ("a", 2), ("b", 1), ("c", 1)]


def test_the_batch_lookups_agree_with_one_at_a_time(core: Coordinator) -> None:
    """What a batch reads for all its peers at once is what each would read alone."""
    now = time.time()
    peers = [join(core, now - 100 + i) for i in range(5)]
    core.record_reports([verified(core, p, now, round=1, samples=8) for p in peers[:2]])
    keys = [p.public_key.id for p in peers] + ["ed25519:nobody"]
    clocks = core.store.report_clock_starts(keys)
    assert clocks == {k: core.store.report_clock_start(k) for k in keys if core.store.report_clock_start(k) is not None}
    assert len(clocks) == 5 and clocks[keys[0]] == pytest.approx(now, abs=1e-3)
    firsts = core.store.first_seen_of_many(keys)
    assert firsts == {k: core.store.first_seen(k) for k in keys if core.store.first_seen(k) is not None}
    assert len(firsts) == 5


def test_a_report_of_a_peer_banned_while_it_waited_is_refused(core: Coordinator) -> None:
    """Verified (admitted then), recorded after an operator's ban: refused, as when the ban
    had come first."""
    now = time.time()
    peer = join(core, now - 60)
    waiting = verified(core, peer, now, round=1, samples=8)
    core.ban(peer.public_key.id, "test", now=now)
    (outcome,) = core.record_reports([waiting])
    assert isinstance(outcome, AdmissionError)
    assert not core.store.claims(key=peer.public_key.id)
