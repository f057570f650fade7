"""A heartbeat process's ``Front`` fed by a real coordinator core as ``coordinator.front.link``
feeds it, for the tests of its gRPC and datagram sides."""

from __future__ import annotations

import time
from typing import Any

import grpc

from coordinator.core import Coordinator
from coordinator.front.process import Front, FrontConfig
from coordinator.front.wire import Answers, Beats
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class Context:
    def peer(self) -> str:
        return "ipv4:10.0.0.9:4000"

    def abort(self, code: grpc.StatusCode, details: str) -> Any:
        raise Refused(code, details)


def request(peer: Identity, body: pb.HeartbeatBody | None = None, *, at: float | None = None) -> bytes:
    body = body or pb.HeartbeatBody(round=3, phase=pb.PEER_PHASE_TRAINING)
    signed = sign_message(peer, kinds.HEARTBEAT, body.SerializeToString(), now=time.time() if at is None else at)
    return pb.HeartbeatRequest(signed=signed.to_proto()).SerializeToString()


def joined(core: Coordinator) -> Identity:
    peer = Identity.generate()
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time())
    return peer


class Wire:
    """A front fed by ``core`` as the link feeds it, its batches kept to hand to the core."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        self.sent: list[object] = []
        config = FrontConfig(
            host="127.0.0.1",
            port=0,
            reuse_port=False,
            max_requests_per_source=0,
            heartbeat_interval_s=5.0,
            max_age_s=300.0,
            max_future_s=30.0,
        )
        self.front = Front(config, self.sent.append)
        self.seq = 0

    def sync(self) -> None:
        answers, dropped = self.core.beats.drain()
        self.seq += 1
        self.front.apply(Answers(self.seq, answers, dropped))

    def beat(self, raw: bytes) -> pb.HeartbeatResponse:
        return self.front.heartbeat(raw, Context())  # type: ignore[arg-type]

    def deliver(self) -> int:
        """Flush the front's batch to the core; how many beats it applied."""
        self.sent.clear()
        self.front.flush()
        batches = [b for b in self.sent if isinstance(b, Beats)]
        return sum(self.core.beats.apply_beats(b.beats, now=time.time()) for b in batches)
