"""Heartbeats as UDP datagrams (``protocol.heartbeat_datagram``): a heartbeat process answers
only a checked beat from an admitted peer, tagged with its nonce, with what gRPC would answer;
whatever a stranger, a replayer, a forger or a flood sends gets no answer and changes nothing;
the peer takes only its own beat's answer and goes over gRPC, signed afresh, when none comes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from coordinator.core import Coordinator
from coordinator.front import flood_guard, process
from coordinator.front.datagrams import open_socket, serve
from coordinator.ratelimit import SourceLimiter
from peer.link import datagram_beats
from peer.link.datagram_beats import DatagramBeats
from protocol import coordinator_pb2 as pb
from protocol.heartbeat_datagram import MAX_DATAGRAM_BYTES, REQUEST_TAG, answer, parse_answer
from protocol.identity import Identity
from tests.unit.front_wire import Wire, joined, request


def datagram(raw: bytes) -> bytes:
    return REQUEST_TAG + raw


def nonce_of(raw: bytes) -> bytes:
    return bytes(pb.HeartbeatRequest.FromString(raw).signed.nonce)


def test_an_admitted_peers_beat_is_answered_as_grpc_would_and_reaches_the_core(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    raw = request(peer, pb.HeartbeatBody(round=7, phase=pb.PEER_PHASE_AVERAGING))
    reply = wire.front.datagram(datagram(raw), "10.0.0.9")
    assert reply is not None and len(reply) < len(datagram(raw))  # the port amplifies nothing
    nonce, response = parse_answer(reply)
    assert nonce == nonce_of(raw) and response.admitted and response.HasField("credited_samples")
    assert wire.deliver() == 1
    health = core.health.get(peer.public_key.id)
    assert health is not None and (health.round, health.phase) == (7, "averaging")


def test_a_strangers_beat_gets_no_answer_and_nothing_is_recorded(core: Coordinator) -> None:
    wire = Wire(core)
    stranger = Identity.generate()
    assert wire.front.datagram(datagram(request(stranger)), "10.0.0.9") is None
    assert len(wire.front.verifier.replay_guard) == 0
    assert wire.deliver() == 0 and core.health.get(stranger.public_key.id) is None


def test_a_replayed_or_forged_beat_gets_no_answer_and_is_applied_once(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    raw = request(peer, pb.HeartbeatBody(round=4))
    assert wire.front.datagram(datagram(raw), "10.0.0.9") is not None
    assert wire.front.datagram(datagram(raw), "10.0.0.66") is None  # the same beat from elsewhere
    forged = pb.HeartbeatRequest.FromString(request(peer, pb.HeartbeatBody(round=5)))
    forged.signed.body = pb.HeartbeatBody(round=99).SerializeToString()  # changed after signing
    assert wire.front.datagram(datagram(forged.SerializeToString()), "10.0.0.66") is None
    assert wire.deliver() == 1
    health = core.health.get(peer.public_key.id)
    assert health is not None and health.round == 4


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"stH",
        b"GET / HTTP/1.1\r\n\r\n",
        REQUEST_TAG + b"\xff" * 40,
        REQUEST_TAG + b"\x00" * (MAX_DATAGRAM_BYTES + 10),
        b"stA1" + b"\x00" * 30,  # an answer sent back to the port
    ],
)
def test_garbage_gets_no_answer_and_changes_nothing(core: Coordinator, junk: bytes) -> None:
    wire = Wire(core)
    joined(core)
    wire.sync()
    assert wire.front.datagram(junk, "10.0.0.9") is None
    assert wire.deliver() == 0 and len(wire.front.verifier.replay_guard) == 0


def test_an_out_of_bounds_beat_gets_no_answer(core: Coordinator) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    raw = request(peer, pb.HeartbeatBody(punched_peers=10**9))
    assert wire.front.datagram(datagram(raw), "10.0.0.9") is None
    assert wire.deliver() == 0


def test_a_flooding_source_is_cut_off_and_others_are_still_answered(core: Coordinator) -> None:
    wire = Wire(core)
    wire.front.datagram_limiter = SourceLimiter(5.0, burst=10)
    peers = [joined(core) for _ in range(2)]
    wire.sync()
    flood = [wire.front.datagram(datagram(request(peers[0])), "10.0.0.66") for _ in range(40)]
    assert 10 <= sum(reply is not None for reply in flood) < 20  # the burst, then what the rate refills
    assert wire.front.datagram(datagram(request(peers[1])), "10.0.0.9") is not None


class Server:
    """A UDP heartbeat port on loopback answering with ``reply(data)``, on the real reader."""

    def __init__(self, reply: Callable[[bytes, str], bytes | None]) -> None:
        self.sock = open_socket("127.0.0.1", 0, reuse_port=False)
        self.port = int(self.sock.getsockname()[1])
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=serve, args=(self.sock, reply, self.stopped), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def server_of() -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def make(reply: Callable[[bytes, str], bytes | None]) -> Server:
        made.append(Server(reply))
        return made[-1]

    yield make
    for server in made:
        server.close()


def beat(peer: Identity) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest.FromString(request(peer))


def test_a_peer_takes_its_own_beats_answer_over_a_real_socket(
    core: Coordinator, server_of: Callable[..., Server]
) -> None:
    wire = Wire(core)
    peer = joined(core)
    wire.sync()
    server = server_of(wire.front.datagram)
    beats = DatagramBeats("127.0.0.1", server.port, timeout_s=10.0)  # a loaded machine's reader may lag
    try:
        for _ in range(3):
            response = beats.send(beat(peer))
            assert response is not None and response.admitted
        assert (beats.answered, beats.missed) == (3, 0)
        beats.timeout_s = 0.5
        assert beats.send(beat(Identity.generate())) is None  # a stranger: silence, then gRPC
        assert wire.deliver() == 3
    finally:
        beats.close()


def test_answers_to_other_beats_and_forged_answers_are_ignored(server_of: Callable[..., Server]) -> None:
    """Before the real answer the peer's socket receives: a forged one from another port (the
    connected socket drops it), an answer to an earlier beat, and garbage."""
    peer = Identity.generate()
    client: list[tuple[str, int]] = []

    def reply(data: bytes, source: str) -> bytes | None:
        nonce = nonce_of(data[len(REQUEST_TAG) :])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            other.sendto(answer(nonce, pb.HeartbeatResponse(message="from another port")), client[0])
        server.sock.sendto(answer(b"\x01" * 16, pb.HeartbeatResponse(message="an earlier beat's")), client[0])
        server.sock.sendto(b"garbage", client[0])
        return answer(nonce, pb.HeartbeatResponse(admitted=True, server_time=1.0))

    server = server_of(reply)
    beats = DatagramBeats("127.0.0.1", server.port, timeout_s=10.0)
    client.append(beats.sock.getsockname())
    try:
        response = beats.send(beat(peer))
        assert response is not None and response.admitted and response.server_time == 1.0
        assert (beats.answered, beats.missed) == (1, 0)
    finally:
        beats.close()


def test_unanswered_beats_rest_after_three(server_of: Callable[..., Server]) -> None:
    server = server_of(lambda data, source: None)
    beats = DatagramBeats("127.0.0.1", server.port, timeout_s=0.2)
    try:
        for _ in range(datagram_beats.MISSES_TO_REST):
            assert beats.send(beat(Identity.generate())) is None
        assert beats.resting and beats.missed == datagram_beats.MISSES_TO_REST
        # resting: nothing sent nor waited for (a wait would count a fourth miss)
        assert beats.send(beat(Identity.generate())) is None and beats.missed == datagram_beats.MISSES_TO_REST
    finally:
        beats.close()


def test_a_flood_from_forged_sources_is_bounded_and_honest_peers_keep_their_datagrams(
    core: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A datagram's source can be forged, so a flood from thousands of addresses passes every
    per-source limit: strangers' keys and replays cost no signature check; forged signatures of
    an admitted key are checked up to a burst, then only keys whose last good beat came from the
    same address are checked (once per ``PER_KEY_S`` each): a peer beating before the flood keeps
    its datagrams, one that had none goes over gRPC until the flood ends."""
    wire = Wire(core)
    steady, newcomer = joined(core), joined(core)
    wire.sync()
    assert wire.front.datagram(datagram(request(steady)), "10.0.0.9") is not None  # before the flood
    checks = [0]
    verify = wire.front.verifier.verify

    def counted(*args: object, **kwargs: object) -> object:
        checks[0] += 1
        return verify(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(wire.front.verifier, "verify", counted)
    strangers = [datagram(request(Identity.generate())) for _ in range(50)]
    captured = datagram(request(steady))
    assert wire.front.datagram(captured, "10.0.0.9") is not None
    checks[0] = 0
    for index, junk in enumerate([*strangers, captured] * 20):
        assert wire.front.datagram(junk, f"198.51.{index // 250}.{index % 250}") is None
    assert checks[0] == 0

    forged = pb.HeartbeatRequest.FromString(request(steady))
    forged.signed.signature = bytes(64)
    flood = datagram(forged.SerializeToString())
    started = time.monotonic()
    for index in range(3000):
        assert wire.front.datagram(flood, f"203.0.{index // 250}.{index % 250}") is None
    refilled = flood_guard.FAILED_PER_S * (time.monotonic() - started)  # the budget's refill meanwhile
    assert checks[0] <= flood_guard.FAILED_BURST + refilled + 1, (checks[0], refilled)  # the burst, then shed
    assert checks[0] < 3000 - 1000  # most of the flood was dropped unchecked
    assert wire.front.datagram(datagram(request(steady)), "10.0.0.9") is not None  # proven: still answered
    assert wire.front.datagram(datagram(request(steady)), "10.0.0.9") is None  # once per PER_KEY_S
    assert wire.front.datagram(datagram(request(newcomer)), "10.0.0.10") is None  # over gRPC meanwhile
    clock = time.monotonic() + flood_guard.SHED_S + 1
    monkeypatch.setattr(process.time, "monotonic", lambda: clock)  # the flood is over
    assert wire.front.datagram(datagram(request(newcomer)), "10.0.0.10") is not None
    assert wire.deliver() == 4


def test_a_taken_udp_number_costs_only_the_datagrams() -> None:
    """A fixed ``--heartbeat-port`` whose UDP number something else holds: the heartbeat process
    still serves gRPC there (peers beat over it), rather than failing the coordinator's start."""
    from concurrent import futures

    import grpc

    from coordinator.front.process import FrontConfig, _listen
    from protocol.ports import unassigned_port

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        while True:  # a number free on TCP, held on UDP here
            port = unassigned_port("127.0.0.1")
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        config = FrontConfig("127.0.0.1", port, False, 0.0, 5.0, 300.0, 30.0)
        try:
            assert _listen(server, config) == (port, None)
        finally:
            server.stop(0)
