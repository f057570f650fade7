"""Signed calls of a peer to a coordinator core in the claims tests: join, report a round,
heartbeat, and a report's group."""

from __future__ import annotations

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message


def join(core: Coordinator, now: float) -> Identity:
    peer = Identity.generate()
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)
    return peer


def report(core: Coordinator, peer: Identity, now: float, **fields: object) -> pb.RoundReportResponse:
    body = pb.RoundReportBody(**fields)  # type: ignore[arg-type]
    envelope = sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=now)
    return core.report_round(envelope.to_proto(), now=now)


def heartbeat(core: Coordinator, peer: Identity, now: float, **fields: object) -> pb.HeartbeatResponse:
    body = pb.HeartbeatBody(**fields)  # type: ignore[arg-type]
    return core.heartbeat(sign_message(peer, kinds.HEARTBEAT, body.SerializeToString(), now=now).to_proto(), now=now)


def group(members: list[Identity], weight: float) -> list[pb.GroupMember]:
    return [pb.GroupMember(public_key=m.public_key.raw, weight=weight) for m in members]
