"""Heartbeats carry the trainer's phase, so the coordinator's health view can show a peer
that waits for its averaging group as 'averaging'."""

from __future__ import annotations

from typing import Any

from peer.link.coordinator_client import JoinAs
from peer.link.coordinator_link import CoordinatorLink
from protocol import coordinator_pb2 as pb
from tests.unit.round_rows import row

METRICS = row(3, averaged=False, digest="sha256:x", samples=40, wall_s=2.0)


def link() -> CoordinatorLink:
    return CoordinatorLink(object(), interval_s=5.0, rejoin=JoinAs())  # type: ignore[arg-type]


def test_a_joining_peer_says_joining_until_its_first_round() -> None:
    assert link().heartbeat_body().phase == pb.PEER_PHASE_JOINING


def test_the_phase_follows_the_trainer() -> None:
    peer = link()
    peer.report(METRICS)
    phase: list[Any] = ["training"]
    peer.phase_of = lambda: phase[0]
    assert peer.heartbeat_body().phase == pb.PEER_PHASE_TRAINING
    phase[0] = "averaging"
    body = peer.heartbeat_body()
    assert body.phase == pb.PEER_PHASE_AVERAGING and body.round == 3 and body.samples_total == 40
    assert peer.status.phase == pb.PEER_PHASE_TRAINING  # the stored figures are left alone


def test_a_leaving_peer_says_leaving_whatever_the_trainer_does() -> None:
    peer = link()
    peer.status = pb.HeartbeatBody(round=3, phase=pb.PEER_PHASE_LEAVING)
    peer.phase_of = lambda: "averaging"
    assert peer.heartbeat_body().phase == pb.PEER_PHASE_LEAVING
