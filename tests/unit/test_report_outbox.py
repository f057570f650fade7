"""Round reports leave at once and survive a killed peer (``peer.link.report_outbox``,
``peer.link.coordinator_link``): before, a report waited in memory for the next heartbeat (seconds
to a minute) and died with the process, and its round's pair credited neither member."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from peer.link import report_outbox
from peer.link.coordinator_client import CoordinatorUnavailableError, JoinAs
from peer.link.coordinator_link import CoordinatorLink
from peer.link.report_outbox import OUTBOX_DIR, ReportOutbox
from protocol import coordinator_pb2 as pb
from protocol.errors import AdmissionError
from protocol.identity import Identity
from protocol.tokens import issue_token
from swarmtrain.localswarm import wait_until
from tests.unit.round_rows import row


def body(round_: int) -> pb.RoundReportBody:
    return pb.RoundReportBody(round=round_, samples=10 * round_, state_digest=f"blake3:{round_:064x}")


def test_reports_outlive_the_process_that_kept_them(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    kept = ReportOutbox(where)
    for round_ in (7, 8, 9):
        kept.put(body(round_))
    first = kept.first()
    assert first is not None and first.round == 7
    kept.done(first)
    # the process dies here: a new one over the same folder has what was not answered, in order
    again = ReportOutbox(where)
    assert len(again) == 2
    rounds = []
    while (report := again.first()) is not None:
        rounds.append(report.round)
        assert report == body(report.round)
        again.done(report)
    assert rounds == [8, 9] and not list(where.iterdir())


def test_a_write_cut_short_is_no_report_and_a_garbled_file_is_set_aside(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    ReportOutbox(where).put(body(3))
    (where / "000000000004.pb.tmp").write_bytes(body(4).SerializeToString()[:5])  # killed mid-write
    (where / "000000000005.pb").write_bytes(b"\xff\xff\xff not a report")
    outbox = ReportOutbox(where)
    assert len(outbox) == 1 and outbox.first() == body(3)
    assert sorted(p.name for p in where.iterdir()) == ["000000000003.pb", "000000000005.unreadable"]


def test_the_outbox_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_outbox, "MAX_PENDING", 3)
    outbox = ReportOutbox(tmp_path)
    for round_ in range(5):
        outbox.put(body(round_))
    assert len(outbox) == 3 and outbox.first() == body(2)
    assert len(list(tmp_path.glob("*.pb"))) == 3
    assert len(ReportOutbox(tmp_path)) == 3


def test_done_only_drops_the_report_it_names(tmp_path: Path) -> None:
    outbox = ReportOutbox(tmp_path)
    outbox.put(body(1))
    outbox.done(body(1))  # an equal report, not the one ``first`` gave: nothing goes
    assert len(outbox) == 1


class FakeCoordinator:
    """Answers heartbeats, takes reports; ``down`` makes every call fail as unreachable."""

    def __init__(self) -> None:
        self.down = False
        self.admitted = True
        self.reports: list[int] = []
        self.heartbeats = 0
        self.joins = 0
        self.lock = threading.Lock()

    def heartbeat(self, body: pb.HeartbeatBody) -> pb.HeartbeatResponse:
        self._answer()
        with self.lock:
            self.heartbeats += 1
        return pb.HeartbeatResponse(admitted=self.admitted, message="restarted: join again")

    def join_as(self, who: JoinAs) -> object:
        self._answer()
        self.joins += 1
        self.admitted = True
        return _Joined()

    def report_round(self, report: pb.RoundReportBody) -> pb.RoundReportResponse:
        self._answer()
        if not self.admitted:
            raise AdmissionError("not admitted: join again before reporting")
        with self.lock:
            self.reports.append(report.round)
        return pb.RoundReportResponse(status=pb.CLAIM_STATUS_PENDING)

    def _answer(self) -> None:
        if self.down:
            raise CoordinatorUnavailableError("coordinator 127.0.0.1:1: connection refused")


class _Joined:
    data_slot = None

    @property
    def access_token(self) -> bytes:
        coordinator = Identity.generate()
        token = issue_token(
            coordinator, run_digest="d", peer_key=Identity.generate().public_key, now=time.time(), ttl_s=3600
        )
        return token.to_bytes()


def running_link(coordinator: FakeCoordinator, outbox: ReportOutbox, interval_s: float = 3600.0) -> CoordinatorLink:
    link = CoordinatorLink(coordinator, interval_s=interval_s, rejoin=JoinAs(), outbox=outbox)  # type: ignore[arg-type]
    link.on_token = lambda token: None
    link.start()
    wait_until(lambda: coordinator.heartbeats >= 1 or coordinator.down, 10, "the first heartbeat")
    return link


def test_a_report_goes_at_once_not_at_the_next_heartbeat(tmp_path: Path) -> None:
    coordinator = FakeCoordinator()
    link = running_link(coordinator, ReportOutbox(tmp_path))  # heartbeats an hour apart
    try:
        wait_until(lambda: link.connected, 10, "the link to connect")
        started = time.monotonic()
        link.report(row(4, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))
        wait_until(lambda: coordinator.reports == [4], 10, "the report")
        assert time.monotonic() - started < 10 and coordinator.heartbeats == 1
        assert not list(tmp_path.glob("*.pb"))  # answered: gone from disk
    finally:
        link.stop()


def test_reports_wait_out_an_outage_on_disk_and_go_when_it_ends(tmp_path: Path) -> None:
    coordinator = FakeCoordinator()
    link = running_link(coordinator, ReportOutbox(tmp_path), interval_s=0.2)
    try:
        wait_until(lambda: link.connected, 10, "the link to connect")
        coordinator.down = True
        link.report(row(5, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))
        link.report(row(6, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))
        wait_until(lambda: not link.connected, 10, "the link to notice the outage")
        assert len(list(tmp_path.glob("*.pb"))) == 2 and coordinator.reports == []
        coordinator.down = False
        wait_until(lambda: coordinator.reports == [5, 6], 10, "the reports after the outage")
    finally:
        link.stop()


def test_a_killed_peers_reports_go_when_it_starts_again(tmp_path: Path) -> None:
    """The peer is killed while its coordinator is away: its reports wait on disk and the next
    process with the same checkpoint directory sends them once it is connected."""
    coordinator = FakeCoordinator()
    coordinator.down = True
    dead = CoordinatorLink(coordinator, interval_s=3600.0, rejoin=JoinAs(), outbox=ReportOutbox(tmp_path))  # type: ignore[arg-type]
    dead.report(row(9, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))  # never started: killed
    coordinator.down = False
    link = running_link(coordinator, ReportOutbox(tmp_path))
    try:
        wait_until(lambda: coordinator.reports == [9], 10, "the earlier run's report")
    finally:
        link.stop()


def test_a_coordinator_that_restarted_is_joined_again_before_the_report_not_taken_as_a_refusal(
    tmp_path: Path,
) -> None:
    """Between heartbeats the coordinator restarted and no longer knows the peer: the report's
    "not admitted" brings the heartbeat forward (which joins again), and the report follows: it
    is not taken for a refusal (a banned peer's own heartbeat is)."""
    coordinator = FakeCoordinator()
    link = running_link(coordinator, ReportOutbox(tmp_path))
    try:
        wait_until(lambda: link.connected, 10, "the link to connect")
        coordinator.admitted = False
        link.report(row(2, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))
        wait_until(lambda: coordinator.reports == [2], 10, "the report after joining again")
        assert coordinator.joins == 1 and not link.refused
    finally:
        link.stop()


PRE = "blake3:" + "ab" * 32
"""The digest of the state an unfinished report's round started from."""


def unfinished(round_: int) -> pb.RoundReportBody:
    landing = body(round_)
    landing.state_digest = ""
    return landing


def test_a_report_left_while_landing_is_finished_by_the_state_the_restarted_peer_holds(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    killed = ReportOutbox(where)
    killed.start(unfinished(12), PRE)
    assert killed.first() is None, "nothing to send without the digest"
    # the peer is killed while it lands round 12; started again, it resumes round 11's checkpoint
    again = ReportOutbox(where)
    assert again.unfinished() == [(12, PRE)] and again.first() is None
    assert not again.holds(11, "blake3:" + "11" * 32)
    assert again.unfinished() == [(12, PRE)]
    # and adopts the swarm's round 12 (its group's, digest verified): the report goes with it
    assert again.holds(12, body(12).state_digest)
    sent = again.first()
    assert sent is not None and sent.round == 12 and sent.samples == 120 and sent.state_digest == body(12).state_digest
    assert again.unfinished() == [] and not list(where.glob("*.landing"))
    assert ReportOutbox(where).first() == sent, "on disk as a whole report"


def test_a_landed_round_replaces_its_unfinished_report(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    outbox = ReportOutbox(where)
    outbox.start(unfinished(5), PRE)
    outbox.start(unfinished(6), PRE)
    outbox.put(body(6))  # round 5's landing never ended in a report (the peer re-synced): it can never be
    assert outbox.unfinished() == [] and not list(where.glob("*.landing"))
    assert [outbox.first().round] == [6]  # type: ignore[union-attr]


def test_a_later_state_drops_reports_that_can_no_longer_be_finished(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    ReportOutbox(where).start(unfinished(12), PRE)
    again = ReportOutbox(where)
    assert not again.holds(15, "blake3:" + "15" * 32)  # the swarm moved on while it was away
    assert again.unfinished() == [] and again.first() is None and not list(where.iterdir())


def test_the_link_sends_a_finished_report_at_once(tmp_path: Path) -> None:
    sent: list[int] = []

    class Client:
        def report_round(self, report: pb.RoundReportBody) -> pb.RoundReportResponse:
            sent.append(report.round)
            return pb.RoundReportResponse()

    outbox = ReportOutbox(tmp_path / OUTBOX_DIR)
    outbox.start(unfinished(3), PRE)
    link = CoordinatorLink(Client(), interval_s=3600, rejoin=JoinAs(), outbox=outbox)  # type: ignore[arg-type]
    link.connected = True
    link._send_reports()
    assert sent == []
    link.holds(3, body(3).state_digest)
    link._send_reports()
    assert sent == [3] and len(outbox) == 0


def test_an_unfinished_report_that_does_not_parse_is_set_aside(tmp_path: Path) -> None:
    where = tmp_path / OUTBOX_DIR
    ReportOutbox(where).start(unfinished(7), PRE)
    (where / f"{8:012d}.landing").write_bytes(b"{not json")
    again = ReportOutbox(where)
    assert again.unfinished() == [(7, PRE)]
    assert [p.name for p in where.glob("*.unreadable")] == [f"{8:012d}.unreadable"]


class SlowCoordinator(FakeCoordinator):
    """Takes each report in ``report_s`` (a busy coordinator on a loaded database)."""

    report_s = 0.05

    def report_round(self, report: pb.RoundReportBody) -> pb.RoundReportResponse:
        time.sleep(self.report_s)
        return super().report_round(report)


def test_a_backlog_of_reports_never_holds_back_the_heartbeats(tmp_path: Path) -> None:
    """The reports of every round of an outage go once the coordinator is back, between
    heartbeats: these keep their interval while the backlog drains (before, the first heartbeat
    after the outage sent all of them before the next could go, and a peer whose backlog took
    longer than the coordinator's window was counted offline)."""
    coordinator = SlowCoordinator()
    link = running_link(coordinator, ReportOutbox(tmp_path), interval_s=0.2)
    try:
        wait_until(lambda: link.connected, 10, "the link to connect")
        coordinator.down = True
        for round_ in range(60):
            link.report(row(round_, averaged=True, digest="blake3:x", samples=40, wall_s=2.0))
        wait_until(lambda: not link.connected, 10, "the link to notice the outage")
        beats = coordinator.heartbeats
        coordinator.down = False
        wait_until(lambda: len(coordinator.reports) >= 30, 20, "half the backlog")  # 1.5 s of reports
        assert coordinator.heartbeats - beats >= 4, "the heartbeats waited for the backlog"
        wait_until(lambda: coordinator.reports == list(range(60)), 20, "the whole backlog, in order")
    finally:
        link.stop()
