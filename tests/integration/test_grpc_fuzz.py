"""Random bytes and oversized requests to every method of a real gRPC coordinator server
(``coordinator.servicer.add_to_server`` on loopback): each is refused with a clear status
(INVALID_ARGUMENT for bytes that are not the method's request, RESOURCE_EXHAUSTED past the
size cap), never INTERNAL or UNKNOWN, and the server keeps answering (issue #14)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message

from coordinator.core import Coordinator
from coordinator.ratelimit import SourceLimiter
from coordinator.servicer import MAX_REQUEST_BYTES, SERVER_OPTIONS, SERVICE, CoordinatorServicer, add_to_server
from coordinator.store import Store, sqlite_url
from protocol import coordinator_pb2 as pb
from protocol.identity import Identity
from protocol.spec import parse_spec

METHODS = [method.name for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]
ACCEPTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def serve(tmp_path: Path, limiter: SourceLimiter | None = None) -> Iterator[grpc.Channel]:
    spec = '[run]\nname = "grpc-fuzz"\n'
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(spec), spec_toml=spec, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    add_to_server(CoordinatorServicer(core), server, limiter=limiter)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)])
    try:
        yield channel
    finally:
        channel.close()
        server.stop(grace=None)
        store.close()


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[grpc.Channel]:
    yield from serve(tmp_path)


def raw_call(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None)
    try:
        call(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_random_bytes_to_every_method_get_clear_refusals(channel: grpc.Channel) -> None:
    rng = random.Random(14)
    seen: dict[grpc.StatusCode, int] = {}
    started = time.monotonic()
    for i in range(1500):
        method = METHODS[i % len(METHODS)]
        size = rng.choice([0, 1, 2, 7, 40, 300, 3000])
        payload = bytes(rng.getrandbits(8) for _ in range(size))
        if i % 3 == 0:  # half-valid: a well-formed envelope field holding garbage
            payload = pb.JoinRequest(signed=pb.SignedEnvelope(kind="x", body=payload)).SerializeToString()
        code = raw_call(channel, method, payload)
        # the doctor's probe has a tighter budget per source (coordinator.probe)
        limited = method == "Probe" and code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code in ACCEPTED or limited, (method, payload[:40], code)
        seen[code] = seen.get(code, 0) + 1
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 500, seen
    assert time.monotonic() - started < 300


def test_an_oversized_request_is_refused_and_the_server_keeps_answering(channel: grpc.Channel) -> None:
    assert raw_call(channel, "Heartbeat", b"\x0a" + b"\xff" * (MAX_REQUEST_BYTES + 10)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert raw_call(channel, "GetStatus", b"") == grpc.StatusCode.OK


def test_a_source_over_its_rate_is_refused_before_anything_else_and_served_again_later(tmp_path: Path) -> None:
    """(``coordinator.ratelimit``) A burst of 5 then 5 requests a second from one address: the
    6th request at once gets RESOURCE_EXHAUSTED naming the source; after a pause it is served."""
    limiter = SourceLimiter(rate=5.0, burst=5.0)
    for channel in serve(tmp_path, limiter):
        codes = [raw_call(channel, "GetStatus", pb.StatusRequest().SerializeToString()) for _ in range(12)]
        assert codes[:5] == [grpc.StatusCode.OK] * 5, codes
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes[5:], codes
        call = channel.unary_unary(f"/{SERVICE}/GetStatus", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(10):
                call(pb.StatusRequest().SerializeToString(), timeout=10)
        assert "too many requests from 127.0.0.1" in str(refused.value.details())
        deadline = time.monotonic() + 10
        while raw_call(channel, "GetStatus", pb.StatusRequest().SerializeToString()) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the source was never served again"
            time.sleep(0.05)


def test_heartbeats_are_answered_while_the_core_is_locked(tmp_path: Path) -> None:
    """With the core's lock held (a long tick, a burst of reports), a heartbeat is still answered:
    heartbeats never take the lock (``Coordinator.heartbeat`` is thread-safe); a report waits
    for the lock and goes through once it is free."""
    from concurrent.futures import ThreadPoolExecutor

    from protocol import kinds
    from protocol.messages import sign_message

    spec = '[run]\nname = "grpc-locked"\n'
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(spec), spec_toml=spec, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    servicer = CoordinatorServicer(core)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    peer = Identity.generate()

    def signed(kind: str, body: Message) -> pb.SignedEnvelope:
        return sign_message(peer, kind, body.SerializeToString(), now=time.time()).to_proto()

    def rpc(method: str, request: Message, timeout: float) -> bytes:
        call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None)
        return call(request.SerializeToString(), timeout=timeout)

    try:
        join = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
        rpc("Join", pb.JoinRequest(signed=signed(kinds.JOIN, join)), 10)
        group = [pb.GroupMember(public_key=peer.public_key.raw, weight=1.0)]
        report = pb.RoundReportBody(round=1, samples=1, compute_s=1.0, state_digest="d", group=group)
        with ThreadPoolExecutor(max_workers=1) as pool:
            with servicer.lock:
                waiting = pool.submit(
                    rpc, "ReportRound", pb.RoundReportRequest(signed=signed(kinds.ROUND_REPORT, report)), 30
                )
                beat = pb.HeartbeatRequest(signed=signed(kinds.HEARTBEAT, pb.HeartbeatBody()))
                assert pb.HeartbeatResponse.FromString(rpc("Heartbeat", beat, 5)).admitted
                assert not waiting.done()  # the report waits for the lock
            answer = pb.RoundReportResponse.FromString(waiting.result(timeout=30))
        assert answer.reason.startswith("pending")
    finally:
        channel.close()
        server.stop(grace=None)
        store.close()
