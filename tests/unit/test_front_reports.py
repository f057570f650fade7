"""Round reports through the heartbeat processes (``coordinator.front``, ``coordinator.front_reports``):
checked there as the main port checks them, recorded by the core in its batches and answered only
once committed, whatever a stranger, a forger, a replayer or a banned peer sends."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from coordinator.core import Coordinator
from coordinator.front.process import Refusal as Refused
from coordinator.front.wire import Answers, Report, Reported
from coordinator.front_reports import FrontReports
from coordinator.reports import ReportWriter
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.unit.claim_calls import group, join
from tests.unit.test_heartbeat_front import Wire


def raw_report(peer: Identity, *, at: float | None = None, **fields: object) -> bytes:
    fields = {"round": 1, "samples": 8, "state_digest": "blake3:ab", "group": group([peer], 8)} | fields
    body = pb.RoundReportBody(**fields)  # type: ignore[arg-type]
    signed = sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=time.time() if at is None else at)
    return pb.RoundReportRequest(signed=signed.to_proto()).SerializeToString()


class Core:
    """The core's side as the server wires it: a report writer and ``FrontReports``."""

    def __init__(self, core: Coordinator) -> None:
        self.lock = threading.Lock()
        self.writer = ReportWriter(core.record_reports, self.lock)
        self.taken = FrontReports(lambda: self.writer, core.verifier, core.beats.admitted)

    def deliver(self, wire: Wire) -> int:
        """Hand the front's reports to the core, each answer back to that front; how many."""
        reports = [r for r in wire.sent if isinstance(r, Report)]
        for report in reports:
            wire.sent.remove(report)
            self.taken.take(report, wire.front.reported, now=time.time())
        return len(reports)


def send(wire: Wire, raw: bytes) -> Future[bytes]:
    """A report sent to ``wire``'s front: the future of its peer's answer."""
    answer: Future[bytes] = Future()
    try:
        _, reported = wire.front.submit_report(raw, source="10.0.0.9", now=time.time())
    except Refused as refused:
        answer.set_exception(refused)
        return answer

    def done(reported: Future[Reported]) -> None:
        try:
            answer.set_result(wire.front.report_answer(reported.result()))
        except Refused as refused:
            answer.set_exception(refused)

    reported.add_done_callback(done)
    return answer


def test_a_report_is_answered_only_once_the_core_committed_it(core: Coordinator) -> None:
    wire, inside = Wire(core), Core(core)
    peer = join(core, time.time() - 60)
    wire.sync()
    answered = send(wire, raw_report(peer))
    assert not answered.done()  # nothing is answered before the core recorded it
    assert inside.deliver(wire) == 1
    response = pb.RoundReportResponse.FromString(answered.result(timeout=10))
    assert response.status == pb.CLAIM_STATUS_PENDING
    claims = core.store.claims(limit=10)
    assert [(c.key, c.round, c.samples) for c in claims] == [(peer.public_key.id, 1, 8)]
    inside.writer.close()


def test_a_strangers_forged_or_malformed_report_is_refused_at_the_front(core: Coordinator) -> None:
    wire = Wire(core)
    peer = join(core, time.time() - 60)
    wire.sync()
    forged = pb.RoundReportRequest.FromString(raw_report(peer))
    forged.signed.body = pb.RoundReportBody(round=1, samples=10**6).SerializeToString()  # changed after signing
    cases = {
        raw_report(Identity.generate()): grpc.StatusCode.PERMISSION_DENIED,  # never joined
        forged.SerializeToString(): grpc.StatusCode.UNAUTHENTICATED,
        raw_report(peer, at=time.time() - 3600): grpc.StatusCode.UNAUTHENTICATED,  # too old
        raw_report(peer, samples=-1): grpc.StatusCode.INVALID_ARGUMENT,
        b"\xff\x00garbage": grpc.StatusCode.INVALID_ARGUMENT,
    }
    for raw, code in cases.items():
        with pytest.raises(Refused) as refused:
            send(wire, raw).result(timeout=10)
        assert refused.value.code == code, raw
    assert not any(isinstance(r, Report) for r in wire.sent) and core.store.claims(limit=10) == []


def test_a_report_replayed_to_the_same_or_a_second_front_is_recorded_once(core: Coordinator) -> None:
    first, second, inside = Wire(core), Wire(core), Core(core)
    peer = join(core, time.time() - 60)
    first.sync()
    second.front.apply(Answers(1, core.beats.everyone(), ()))
    raw = raw_report(peer)
    answered = send(first, raw)
    inside.deliver(first)
    answered.result(timeout=10)
    with pytest.raises(Refused) as refused:  # the same front saw it
        send(first, raw).result(timeout=10)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    replayed = send(second, raw)  # the second front has not: the core refuses it
    inside.deliver(second)
    with pytest.raises(Refused) as refused:
        replayed.result(timeout=10)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert len(core.store.claims(limit=10)) == 1
    inside.writer.close()


def test_a_report_of_a_peer_banned_after_the_fronts_check_is_refused(core: Coordinator) -> None:
    wire, inside = Wire(core), Core(core)
    peer = join(core, time.time() - 60)
    wire.sync()
    answered = send(wire, raw_report(peer))
    core.ban(peer.public_key.id, "test", now=time.time())  # the front's table does not know yet
    inside.deliver(wire)
    with pytest.raises(Refused) as refused:
        answered.result(timeout=10)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert core.store.claims(limit=10) == []
    inside.writer.close()


def test_a_report_record_naming_another_key_than_its_signer_is_refused(core: Coordinator) -> None:
    inside = Core(core)
    peer, other = join(core, time.time() - 60), join(core, time.time() - 60)
    signed = sign_message(peer, kinds.ROUND_REPORT, pb.RoundReportBody(round=1).SerializeToString(), now=time.time())
    record = Report(7, other.public_key.id, signed.signer.raw, signed.nonce, signed.timestamp, signed.body, time.time())
    answers: list[Any] = []
    inside.taken.take(record, answers.append, now=time.time())
    assert [(a.id, a.response, a.code) for a in answers] == [(7, None, "PERMISSION_DENIED")]
    inside.writer.close()


def test_a_report_not_answered_before_its_peers_deadline_is_unavailable_and_forgotten(core: Coordinator) -> None:
    wire = Wire(core)
    peer = join(core, time.time() - 60)
    wire.sync()
    waited = wire.front.report(raw_report(peer), source="10.0.0.9", now=time.time(), deadline_s=0.2)
    with pytest.raises(Refused) as refused:
        asyncio.run(waited)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # the peer sends it again later
    assert wire.front._waiting == {}
