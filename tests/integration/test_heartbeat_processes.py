"""A real coordinator's heartbeat process (``coordinator.front``): a peer's heartbeats go to the
port its join answer names and reach the coordinator's status; the port refuses what a stranger
or an attacker sends; when the process dies the peer's heartbeats go to the gRPC port, and the
coordinator starts another that knows every admitted peer."""

from __future__ import annotations

import base64
import os
import socket
import time
from pathlib import Path

import grpc
import pytest

from peer.link.coordinator_client import CoordinatorClient
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol import heartbeat_datagram, kinds
from protocol.identity import Identity, PublicKey
from protocol.messages import sign_message
from protocol.pids import pid_alive
from protocol.spec import parse_spec
from swarmtrain.localswarm import LocalCoordinator, wait_until
from tests.integration.coordinator_status import status
from tests.specs import COORDINATOR_SPEC


def front_pids(coordinator: LocalCoordinator) -> list[int]:
    """The coordinator's heartbeat processes (its children running ``coordinator.front.process``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == coordinator.proc.pid and b"coordinator.front.process" in cmdline:
            pids.append(int(entry))
    return pids


def punched(address: str, key: PublicKey) -> int | None:
    """What the coordinator's status says of ``key``'s punched peers (None: not listed)."""
    for peer in status(address)["peers"]:
        if peer["public_key"] == base64.b64encode(key.raw).decode():
            return int(peer["punched_peers"])
    return None


def signed(peer: Identity, body: pb.HeartbeatBody) -> pb.HeartbeatRequest:
    envelope = sign_message(peer, kinds.HEARTBEAT, body.SerializeToString(), now=time.time())
    return pb.HeartbeatRequest(signed=envelope.to_proto())


@pytest.fixture
def coordinator(tmp_path: Path) -> LocalCoordinator:
    spec = tmp_path / "spec.toml"
    spec.write_text(COORDINATOR_SPEC.format(mode="open", allowlist=""))
    made = LocalCoordinator(spec, tmp_path / "state", host="127.0.0.1")
    yield made
    made.stop()


def test_heartbeats_take_their_port_and_the_gRPC_port_when_it_dies(
    coordinator: LocalCoordinator, tmp_path: Path
) -> None:
    address, beats = coordinator.address(), coordinator.heartbeats()
    digest = parse_spec((tmp_path / "spec.toml").read_text()).digest()
    peer = Identity.generate()
    client = CoordinatorClient(address, peer, software_version="test")
    try:
        info = client.join(libp2p_peer_id="12D3KooWtest", spec_digest=digest)
        assert f"127.0.0.1:{info.heartbeat_port}" == beats != address
        key = peer.public_key

        # the first heartbeat right after the join finds the peer admitted there, as a datagram
        assert client.heartbeat(pb.HeartbeatBody(round=1, punched_peers=3)).admitted
        assert client.datagrams is not None and (client.datagrams.answered, client.datagrams.missed) == (1, 0)
        wait_until(lambda: punched(address, key) == 3, 30, "the heartbeat process's beat in status")

        # what an attacker sends to the heartbeat port
        channel = grpc.insecure_channel(beats)
        stub = pb_grpc.CoordinatorStub(channel)
        stranger = stub.Heartbeat(signed(Identity.generate(), pb.HeartbeatBody(punched_peers=50)), timeout=10)
        assert not stranger.admitted and "join again" in stranger.message
        replayed = signed(peer, pb.HeartbeatBody(punched_peers=4))
        assert stub.Heartbeat(replayed, timeout=10).admitted
        with pytest.raises(grpc.RpcError) as refused:
            stub.Heartbeat(replayed, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        forged = signed(peer, pb.HeartbeatBody(punched_peers=5))
        forged.signed.body = pb.HeartbeatBody(punched_peers=66).SerializeToString()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Heartbeat(forged, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            stub.Heartbeat(signed(peer, pb.HeartbeatBody(state_digest="x" * 40_000)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as refused:  # the heartbeat port takes heartbeats only
            stub.GetStatus(pb.StatusRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        channel.close()
        wait_until(lambda: punched(address, key) == 4, 30, "the last good beat in status")

        # the process dies: heartbeats go to the gRPC port, and another process takes over
        (front,) = front_pids(coordinator)
        os.kill(front, 9)
        wait_until(lambda: not pid_alive(front), 30, "the killed heartbeat process gone")
        assert client.heartbeat(pb.HeartbeatBody(round=2, punched_peers=6)).admitted
        wait_until(lambda: punched(address, key) == 6, 30, "a beat through the gRPC port in status")
        wait_until(lambda: len(front_pids(coordinator)) == 1, 60, "another heartbeat process")
        channel = grpc.insecure_channel(beats)
        stub = pb_grpc.CoordinatorStub(channel)
        answers: list[pb.HeartbeatResponse] = []
        wait_until(
            lambda: _answered(stub, signed(peer, pb.HeartbeatBody(round=3, punched_peers=7)), answers),
            60,
            "the new heartbeat process answers",
        )
        assert answers[-1].admitted  # it knows the peers admitted before it started
        channel.close()
        wait_until(lambda: punched(address, key) == 7, 30, "the new process's beat in status")
        assert stranger.admitted is False and punched(address, Identity.generate().public_key) is None
    finally:
        client.close()


def test_the_datagram_port_answers_only_an_admitted_peers_fresh_beats(
    coordinator: LocalCoordinator, tmp_path: Path
) -> None:
    """What an attacker sends to the heartbeat port's UDP side of a real heartbeat process: a
    stranger's beat, a peer's beat replayed from another socket, a forged one, garbage and a
    flood of it get no answer and change nothing; the peer's own beats are still answered."""
    address, beats = coordinator.address(), coordinator.heartbeats()
    digest = parse_spec((tmp_path / "spec.toml").read_text()).digest()
    peer = Identity.generate()
    client = CoordinatorClient(address, peer, software_version="test")
    host, port = beats.rsplit(":", 1)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.settimeout(1.0)

    def answered(data: bytes) -> bool:
        attacker.sendto(data, (host, int(port)))
        try:
            attacker.recv(2048)
        except TimeoutError:
            return False
        return True

    try:
        client.join(libp2p_peer_id="12D3KooWtest", spec_digest=digest)
        key = peer.public_key
        assert client.heartbeat(pb.HeartbeatBody(punched_peers=3)).admitted
        wait_until(lambda: punched(address, key) == 3, 30, "the datagram beat in status")
        stranger = Identity.generate()
        assert not answered(heartbeat_datagram.request(signed(stranger, pb.HeartbeatBody(punched_peers=50))))
        captured = heartbeat_datagram.request(signed(peer, pb.HeartbeatBody(punched_peers=4)))
        assert answered(captured)  # a beat the peer signed, sent by whoever holds it: once
        assert not answered(captured)
        forged = signed(peer, pb.HeartbeatBody(punched_peers=5))
        forged.signed.body = pb.HeartbeatBody(punched_peers=66).SerializeToString()
        assert not answered(heartbeat_datagram.request(forged))
        for junk in (b"", b"stH1" + os.urandom(300), os.urandom(1500)):
            assert not answered(junk)
        for _ in range(2000):  # a flood of garbage
            attacker.sendto(b"stH1" + os.urandom(200), (host, int(port)))
        fresh = lambda: answered(heartbeat_datagram.request(signed(peer, pb.HeartbeatBody(punched_peers=7))))  # noqa: E731
        wait_until(fresh, 30, "the port to answer the peer's fresh beats after the flood")
        wait_until(lambda: punched(address, key) == 7, 30, "the peer's next beat in status")
        assert punched(address, stranger.public_key) is None
    finally:
        attacker.close()
        client.close()


def _answered(stub: pb_grpc.CoordinatorStub, request: pb.HeartbeatRequest, answers: list) -> bool:
    try:
        answers.append(stub.Heartbeat(request, timeout=5))
    except grpc.RpcError:
        return False
    return True


def test_a_leaving_peer_is_answered_with_the_report_it_just_sent(coordinator: LocalCoordinator, tmp_path: Path) -> None:
    """A peer leaves right after sending its last report: its leaving heartbeat's answer is its
    last account of its work and counts that report, though the heartbeat process's table
    follows the coordinator by up to a tick."""
    digest = parse_spec((tmp_path / "spec.toml").read_text()).digest()
    peer = Identity.generate()
    client = CoordinatorClient(coordinator.address(), peer, software_version="test")
    try:
        client.join(libp2p_peer_id="12D3KooWtest", spec_digest=digest)
        before = client.heartbeat(pb.HeartbeatBody(round=1))
        assert before.admitted and before.pending_samples == 0
        time.sleep(1.0)  # a claim is capped by the time the coordinator saw since the join
        member = pb.GroupMember(public_key=peer.public_key.raw, weight=1.0)
        body = pb.RoundReportBody(
            round=1, samples=1, loss=3.0, group=[member], state_digest="sha256:" + "ab" * 32, compute_s=1.0
        )
        assert client.report_round(body).status == pb.CLAIM_STATUS_PENDING
        last = client.heartbeat(pb.HeartbeatBody(round=1, phase=pb.PEER_PHASE_LEAVING))
        assert last.admitted and last.HasField("credited_samples")
        assert last.pending_samples + last.credited_samples == 1, last
    finally:
        client.close()
