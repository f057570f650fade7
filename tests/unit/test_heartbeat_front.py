"""The heartbeat processes (``coordinator.front``): a heartbeat checked there as the core would,
answered from the table the core keeps, applied by the core once, whatever a stranger, a
replayer or a banned peer sends."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.core import Coordinator
from coordinator.front.wire import Answers, Beat
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.unit.front_wire import Refused, Wire, joined, request


def test_a_joined_peer_is_answered_from_the_table_and_its_figures_reach_the_core(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    answer = wire.beat(request(peer, pb.HeartbeatBody(round=7, phase=pb.PEER_PHASE_AVERAGING)))
    assert answer.admitted and answer.HasField("credited_samples")
    assert wire.deliver() == 1
    health = core.health.get(peer.public_key.id)
    assert health is not None and (health.round, health.phase) == (7, "averaging")


def test_a_stranger_is_told_to_join_and_nothing_of_it_is_recorded(core: Coordinator) -> None:
    wire = Wire(core)
    stranger = Identity.generate()
    answer = wire.beat(request(stranger))
    assert not answer.admitted and "join again" in answer.message
    assert len(wire.front.verifier.replay_guard) == 0
    assert wire.deliver() == 0 and core.health.get(stranger.public_key.id) is None


def test_a_forged_signature_is_refused(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    envelope = pb.HeartbeatRequest.FromString(request(peer))
    envelope.signed.body = pb.HeartbeatBody(round=99).SerializeToString()  # changed after signing
    with pytest.raises(Refused) as refused:
        wire.beat(envelope.SerializeToString())
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert wire.deliver() == 0


def test_a_replay_to_the_same_front_is_refused(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    raw = request(peer)
    wire.beat(raw)
    with pytest.raises(Refused) as refused:
        wire.beat(raw)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert wire.deliver() == 1


def test_a_beat_replayed_to_a_second_front_is_applied_once(core: Coordinator) -> None:
    """Two heartbeat processes guard against replays each on its own: the core applies a
    heartbeat both passed once, and a stale one replayed there does not set its figures back."""
    first, second = Wire(core), Wire(core)
    peer = joined(core)
    first.sync()
    second.front.apply(Answers(1, core.beats.everyone(), ()))
    old = request(peer, pb.HeartbeatBody(round=5))
    first.beat(old)
    assert first.deliver() == 1
    first.beat(request(peer, pb.HeartbeatBody(round=6)))
    assert first.deliver() == 1
    assert second.beat(old).admitted  # the second process has not seen it
    assert second.deliver() == 0
    health = core.health.get(peer.public_key.id)
    assert health is not None and health.round == 6


def test_a_heartbeat_the_main_port_took_is_not_applied_again_from_a_front(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    raw = request(peer, pb.HeartbeatBody(round=4))
    core.heartbeat(pb.HeartbeatRequest.FromString(raw).signed, now=time.time())
    core.heartbeat(pb.HeartbeatRequest.FromString(request(peer, pb.HeartbeatBody(round=8))).signed, now=time.time())
    wire.beat(raw)
    assert wire.deliver() == 0
    health = core.health.get(peer.public_key.id)
    assert health is not None and health.round == 8


def test_a_beat_naming_another_key_than_its_signer_is_not_applied(core: Coordinator) -> None:
    peer, other = joined(core), joined(core)
    signed = sign_message(peer, kinds.HEARTBEAT, pb.HeartbeatBody(round=9).SerializeToString(), now=time.time())
    beat = Beat(other.public_key.id, signed.signer.raw, signed.nonce, signed.timestamp, signed.body, time.time())
    assert core.beats.apply_beats((beat,), now=time.time()) == 0


def test_out_of_bounds_and_malformed_heartbeats_are_refused(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    for raw in (request(peer, pb.HeartbeatBody(round=-1)), b"\xff\x00garbage", request(peer, at=time.time() - 3600)):
        with pytest.raises(Refused) as refused:
            wire.beat(raw)
        assert refused.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)
    assert wire.deliver() == 0


def test_a_banned_peer_is_dropped_from_the_table_and_its_queued_beats_are_not_applied(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    assert wire.beat(request(peer)).admitted
    core.ban(peer.public_key.id, "test", now=time.time())
    assert wire.deliver() == 0  # verified before the ban, applied after it: not taken
    wire.sync()
    assert not wire.beat(request(peer)).admitted


def test_credit_and_data_changes_reach_the_table(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    key = peer.public_key.id
    assert wire.beat(request(peer)).credited_samples == 0
    core.store.record_claim(
        key=key, round=1, samples=40, group_json="[]", state_digest="d", duration_s=1.0, received_at=1.0
    )
    core.store.decide_claim(key=key, round=1, status="granted", granted_samples=32, flops=6.4e9, reason="ok", now=2.0)
    core.credits_changed(key)
    wire.sync()
    answer = wire.beat(request(peer))
    assert (answer.credited_samples, answer.credited_flops) == (32, 6.4e9)
    answers, dropped = core.beats.drain()
    assert not answers and not dropped  # nothing changed since


def test_a_beat_signed_before_one_already_applied_does_not_set_the_peer_back(core: Coordinator) -> None:
    """A datagram that waited in a heartbeat process's queue while its peer, hearing nothing,
    sent a fresh beat over gRPC: the older one arrives second and changes nothing (its round
    going backwards, its failed-round count read as a restart and counted twice)."""
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    at = time.time()
    late = request(peer, pb.HeartbeatBody(round=5, rounds_failed=2), at=at - 2)
    fresh = pb.HeartbeatRequest.FromString(request(peer, pb.HeartbeatBody(round=6, rounds_failed=3), at=at - 1))
    assert core.heartbeat(fresh.signed, now=at).admitted  # over the main port
    wire.beat(late)
    assert wire.deliver() == 0
    health = core.health.get(peer.public_key.id)
    assert health is not None and (health.round, health.rounds_failed) == (6, 3)
    wire.beat(request(peer, pb.HeartbeatBody(round=7, rounds_failed=3), at=at))
    assert wire.deliver() == 1
    health = core.health.get(peer.public_key.id)
    assert health is not None and health.round == 7
