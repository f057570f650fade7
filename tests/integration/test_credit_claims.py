"""Claims over real gRPC into a real coordinator core and database: a peer that over-reports
its samples is granted only what its group attests; forged and replayed reports are refused."""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from coordinator.core import Coordinator
from coordinator.servicer import CoordinatorServicer
from coordinator.store import Store, sqlite_url
from peer.link.coordinator_client import CoordinatorClient, RejectedError
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.spec import parse_spec
from tests.conftest import plain

SPEC = '[run]\nname = "claims"\n[credits]\nmax_samples_per_second = 1000.0\n'


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    spec = parse_spec(SPEC)
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(spec=spec, spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    # a test moves the coordinator's clock ahead (``ahead[0]`` s): a claim's throughput cap is
    # the time the coordinator saw since the peer joined, and the peers here report at once
    ahead = [0.0]
    servicer = CoordinatorServicer(core, clock=lambda: time.time() + ahead[0])
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield core, store, f"127.0.0.1:{port}", ahead
    server.stop(grace=1).wait()
    store.close()


def report(peers: list[Identity], me: Identity, samples: int, seen: dict[str, int]) -> pb.RoundReportBody:
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=float(seen[p.public_key.id])) for p in peers]
    return pb.RoundReportBody(
        round=1, samples=samples, loss=3.0, group=group, state_digest="sha256:" + "ab" * 32, compute_s=1.0, wait_s=0.1
    )


def test_over_reporter_is_granted_only_what_its_group_attests(served) -> None:  # type: ignore[no-untyped-def]
    core, store, address, ahead = served
    peers = [Identity.generate() for _ in range(3)]
    clients = [CoordinatorClient(address, p, software_version="test") for p in peers]
    for client in clients:
        client.join()
    ahead[0] = 10.0  # 10 s of compute since the joins, by the coordinator's clock
    honest = {p.public_key.id: 40 for p in peers}  # what everyone actually contributed
    liar = peers[2]
    for client, me in zip(clients, peers):
        claimed = 1000 if me is liar else 40
        seen = dict(honest, **{me.public_key.id: claimed})  # a peer "sees" its own claim
        client.report_round(report(peers, me, claimed, seen))
    core.tick(now=time.time() + ahead[0])
    credits = plain(store.credits_by_peer())
    assert credits[liar.public_key.id]["samples"] == 40
    assert all(credits[p.public_key.id]["samples"] == 40 for p in peers)
    reason = next(c.reason for c in store.claims(key=liar.public_key.id))
    assert "claimed 1000" in reason and "attested 40" in reason


def test_forged_and_replayed_reports_are_refused(served) -> None:  # type: ignore[no-untyped-def]
    core, store, address, _ = served
    me, other = Identity.generate(), Identity.generate()
    client = CoordinatorClient(address, me, software_version="test")
    client.join()
    body = report([me, other], me, 40, {me.public_key.id: 40, other.public_key.id: 40})
    signed = sign_message(me, kinds.ROUND_REPORT, body.SerializeToString(), now=time.time())
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(address))
    stub.ReportRound(pb.RoundReportRequest(signed=signed.to_proto()), timeout=10)
    with pytest.raises(grpc.RpcError) as replay:
        stub.ReportRound(pb.RoundReportRequest(signed=signed.to_proto()), timeout=10)
    assert replay.value.code() == grpc.StatusCode.UNAUTHENTICATED and "already received" in replay.value.details()
    tampered = signed.to_proto()
    tampered.body = report([me, other], me, 4000, {me.public_key.id: 4000, other.public_key.id: 40}).SerializeToString()
    with pytest.raises(grpc.RpcError) as forged:
        stub.ReportRound(pb.RoundReportRequest(signed=tampered), timeout=10)
    assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stranger = CoordinatorClient(address, Identity.generate(), software_version="test")
    with pytest.raises(Exception, match="not admitted"):
        stranger.report_round(body)
    with pytest.raises(RejectedError):
        stub_body = pb.JoinRequest(signed=pb.SignedEnvelope(kind="x"))
        CoordinatorClient(address, me, software_version="t")._call(stub.Join, stub_body)
