"""The same signed message sent many times at once over real gRPC into a real coordinator
core and database: exactly one copy is accepted (checking a message and recording it are one
step), whatever the kind: join, heartbeat, round report."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from coordinator.core import Coordinator
from coordinator.servicer import CoordinatorServicer
from coordinator.store import Store, sqlite_url
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.spec import parse_spec

SPEC = '[run]\nname = "replays"\n'
COPIES = 24


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[pb_grpc.CoordinatorStub]:
    spec = parse_spec(SPEC)
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(spec=spec, spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=COPIES))
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.CoordinatorStub(channel)
    channel.close()
    server.stop(grace=1).wait()
    store.close()


def send_at_once(call: Callable[[], object]) -> list[grpc.StatusCode]:
    """``call`` from COPIES threads released together; each one's status code."""
    barrier = threading.Barrier(COPIES)

    def one() -> grpc.StatusCode:
        barrier.wait()
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "already received" in str(exc.details())
            return exc.code()
        return grpc.StatusCode.OK

    with futures.ThreadPoolExecutor(COPIES) as pool:
        return list(pool.map(lambda _: one(), range(COPIES)))


def signed(me: Identity, kind: str, body: object) -> pb.SignedEnvelope:
    return sign_message(me, kind, body.SerializeToString(), now=time.time()).to_proto()  # type: ignore[attr-defined]


def test_one_copy_of_each_signed_message_is_accepted(stub: pb_grpc.CoordinatorStub) -> None:
    me, other = Identity.generate(), Identity.generate()
    join = pb.JoinRequest(signed=signed(me, kinds.JOIN, pb.JoinBody(software_version="test")))
    assert send_at_once(lambda: stub.Join(join, timeout=30)).count(grpc.StatusCode.OK) == 1

    beat = pb.HeartbeatRequest(signed=signed(me, kinds.HEARTBEAT, pb.HeartbeatBody(phase=pb.PEER_PHASE_TRAINING)))
    assert send_at_once(lambda: stub.Heartbeat(beat, timeout=30)).count(grpc.StatusCode.OK) == 1

    group = [pb.GroupMember(public_key=p.public_key.raw, weight=8.0) for p in (me, other)]
    body = pb.RoundReportBody(round=1, samples=8, loss=3.0, group=group, state_digest="sha256:" + "ab" * 32)
    report = pb.RoundReportRequest(signed=signed(me, kinds.ROUND_REPORT, body))
    assert send_at_once(lambda: stub.ReportRound(report, timeout=30)).count(grpc.StatusCode.OK) == 1
