"""A peer's heartbeat answer carries its credit as the coordinator's database has it."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.exc import OperationalError

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message


def heartbeat(core: Coordinator, peer: Identity) -> pb.HeartbeatResponse:
    envelope = sign_message(peer, kinds.HEARTBEAT, pb.HeartbeatBody().SerializeToString(), now=time.time())
    return core.heartbeat(envelope.to_proto(), now=time.time())


def joined(core: Coordinator) -> Identity:
    peer = Identity.generate()
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time())
    return peer


def claim(core: Coordinator, key: str, round_: int, samples: int) -> None:
    core.store.record_claim(
        key=key, round=round_, samples=samples, group_json="[]", state_digest="d", duration_s=1.0, received_at=1.0
    )


def test_the_answer_names_granted_and_pending_samples_of_this_peer_only(core: Coordinator) -> None:
    peer, other = joined(core), joined(core)
    first = heartbeat(core, peer)
    assert first.admitted and first.HasField("credited_samples")
    assert (first.credited_samples, first.credited_flops, first.pending_samples) == (0, 0.0, 0)
    claim(core, peer.public_key.id, 1, 40)
    claim(core, peer.public_key.id, 2, 30)
    claim(core, other.public_key.id, 1, 500)
    core.store.decide_claim(
        key=peer.public_key.id, round=1, status="granted", granted_samples=32, flops=6.4e9, reason="attested", now=2.0
    )
    core.credits_changed(peer.public_key.id)  # written behind the core's back
    answer = heartbeat(core, peer)
    assert (answer.credited_samples, answer.credited_flops, answer.pending_samples) == (32, 6.4e9, 30)


def test_an_unreadable_database_leaves_the_credit_out_but_keeps_the_heartbeat(
    core: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = joined(core)

    def broken(key: str) -> dict:
        raise OperationalError("SELECT", {}, Exception("database is locked"))

    monkeypatch.setattr(core.store, "credit_of", broken)
    answer = heartbeat(core, peer)
    assert answer.admitted and not answer.HasField("credited_samples")


def test_a_peer_that_is_not_admitted_learns_no_credit(core: Coordinator) -> None:
    answer = heartbeat(core, Identity.generate())
    assert not answer.admitted and not answer.HasField("credited_samples")


def test_a_members_absurd_gathered_samples_do_not_spoil_the_report() -> None:
    """An attacker that gathered 1e15 samples (or NaN) must not make honest members' reports
    ones the coordinator refuses: its weight is clamped to what a report may carry."""
    from peer.link.report_wire import reported_weight
    from protocol.messages import MAX_REPORTED_SAMPLES

    assert reported_weight(40) == 40.0
    assert reported_weight(10**15) == float(MAX_REPORTED_SAMPLES)
    assert reported_weight(float("inf")) == float(MAX_REPORTED_SAMPLES)
    assert reported_weight(float("nan")) == 0.0
    assert reported_weight(-3) == 0.0
    assert reported_weight("lots") == 0.0


def test_the_figures_follow_reports_and_decisions_without_reading_the_database_again(
    core: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats are the most frequent request: after a peer's first one, its credit is kept in
    memory and moved by each committed report and decision, with no query per heartbeat."""
    peers = [joined(core), joined(core)]
    reads: list[str] = []
    real = core.store.credit_of
    monkeypatch.setattr(core.store, "credit_of", lambda key: reads.append(key) or real(key))
    heartbeat(core, peers[0])
    now = time.time()
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=20.0) for p in peers]
    for peer in peers:
        body = pb.RoundReportBody(round=1, samples=20, compute_s=5.0, state_digest="d", group=group)
        core.report_round(sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=now).to_proto(), now=now)
    pending = heartbeat(core, peers[0])
    assert (pending.credited_samples, pending.pending_samples) == (0, 20)
    core.tick(now=now + 1)
    granted = heartbeat(core, peers[0])
    assert (granted.credited_samples, granted.pending_samples) == (20, 0)
    assert reads == [peers[0].public_key.id]  # only its first heartbeat read the database
    assert granted.credited_samples == real(peers[0].public_key.id).samples


def test_a_resent_report_is_already_reported_before_and_after_a_restart(core: Coordinator) -> None:
    """Peers resend a report whose answer they lost: the same (key, round) is answered "already
    reported" and changes nothing, from the ledger in memory and, after a restart, from the store."""
    peers = [joined(core), joined(core)]
    now = time.time()
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=20.0) for p in peers]

    def report(target: Coordinator, peer: Identity) -> pb.RoundReportResponse:
        body = pb.RoundReportBody(round=1, samples=20, compute_s=5.0, state_digest="d", group=group)
        return target.report_round(
            sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=time.time()).to_proto(), now=now
        )

    assert report(core, peers[0]).reason.startswith("pending")
    assert report(core, peers[0]).reason == "already reported"
    report(core, peers[1])
    core.tick(now=now + 1)
    decided = core.store.claims(round=1)
    restarted = Coordinator(
        spec=core.spec, spec_toml=core.spec_toml, identity=core.identity, store=core.store, bootstrap_maddrs=[]
    )
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=restarted.digest)
    restarted.join(sign_message(peers[0], kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)
    assert report(restarted, peers[0]).reason == "already reported"
    restarted.tick(now=now + 2)
    assert restarted.store.claims(round=1) == decided
