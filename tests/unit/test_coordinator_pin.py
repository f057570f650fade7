"""An on-path attacker between a peer and its coordinator (plain gRPC) tries to swap the run's
spec, bootstrap peers and relays in the join answer (issue #48, low finding 3). The coordinator
signs each answer, bound to the request (``protocol.kinds.JOIN_ANSWER``); the peer reads the
answer only from the signed body and refuses a signer other than the key it pinned
(``--coordinator-key``, or the first key met at that address: ``peer.link.coordinator_pin``). Real
gRPC servers on loopback: the real coordinator, and an impostor in front of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from coordinator.core import Coordinator
from coordinator.servicer import CoordinatorServicer
from peer.link.coordinator_client import CoordinatorClient
from peer.link.coordinator_pin import PINS_FILE, CoordinatorIdentityError, PinnedKeys
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol.errors import ConfigError
from protocol.identity import Identity
from tests.unit.conftest import new_core

EVIL_SPEC = '[run]\nname = "evil"\n'
EVIL_RELAY = "203.0.113.9:4000"


def _serve(servicer: pb_grpc.CoordinatorServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class Impostor(pb_grpc.CoordinatorServicer):
    """Answers joins in front of the real coordinator, changing the answer with ``rewrite``."""

    def __init__(self, real: str, rewrite: Callable[[pb.JoinResponse], pb.JoinResponse]) -> None:
        self.real = pb_grpc.CoordinatorStub(grpc.insecure_channel(real))
        self.rewrite = rewrite
        self.captured: list[pb.JoinResponse] = []

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        answer = self.real.Join(request, timeout=10)
        self.captured.append(answer)
        return self.rewrite(answer)


@pytest.fixture
def real(tmp_path: Path) -> Iterator[tuple[Coordinator, str]]:
    (tmp_path / "real").mkdir()
    core = new_core(tmp_path / "real")
    server, address = _serve(CoordinatorServicer(core))
    yield core, address
    server.stop(None)
    core.store.close()


def _client(address: str, **kwargs: object) -> CoordinatorClient:
    return CoordinatorClient(address, Identity.generate(), software_version="test", **kwargs)  # type: ignore[arg-type]


def _through(real: str, rewrite: Callable[[pb.JoinResponse], pb.JoinResponse]) -> tuple[grpc.Server, str, Impostor]:
    impostor = Impostor(real, rewrite)
    server, address = _serve(impostor)
    return server, address, impostor


def test_an_honest_answer_is_signed_by_the_coordinator_and_pinned_on_first_use(
    real: tuple[Coordinator, str], tmp_path: Path
) -> None:
    core, address = real
    pins = PinnedKeys(tmp_path)
    client = _client(address, coordinator_key=pins.expected(address))
    info = client.join()
    assert info.coordinator_key == core.identity.public_key and info.spec_digest == core.digest
    pins.remember(address, info.coordinator_key)
    assert PinnedKeys(tmp_path).expected(address) == core.identity.public_key
    assert client.join().coordinator_key == core.identity.public_key  # a re-join, same key


def test_a_fake_coordinator_with_its_own_key_is_refused_when_pinned(
    real: tuple[Coordinator, str], tmp_path: Path
) -> None:
    core, _ = real
    (tmp_path / "evil").mkdir()
    evil = new_core(tmp_path / "evil", EVIL_SPEC)
    server, address = _serve(CoordinatorServicer(evil))
    try:
        # pinned by the operator's printed key
        with pytest.raises(CoordinatorIdentityError, match="not the coordinator's"):
            _client(address, coordinator_key=core.identity.public_key).join()
        # pinned on first use: this peer met the real coordinator at this address before
        (tmp_path / PINS_FILE).write_text(f'{{"{address}": "{core.identity.public_key.id}"}}')
        with pytest.raises(CoordinatorIdentityError, match="--coordinator-key"):
            _client(address, coordinator_key=PinnedKeys(tmp_path).expected(address)).join()
    finally:
        server.stop(None)
        evil.store.close()


def test_fields_rewritten_outside_the_signature_change_nothing(real: tuple[Coordinator, str]) -> None:
    core, address = real

    def swap(answer: pb.JoinResponse) -> pb.JoinResponse:
        answer.spec_toml, answer.spec_digest = EVIL_SPEC, "sha256:" + "0" * 64
        answer.relays[:] = [EVIL_RELAY]
        answer.bootstrap_maddrs[:] = ["/ip4/203.0.113.9/tcp/1/p2p/QmEvil"]
        return answer

    server, front, _ = _through(address, swap)
    try:
        info = _client(front, coordinator_key=core.identity.public_key).join()
    finally:
        server.stop(None)
    assert info.spec_toml == core.spec_toml and info.spec_digest == core.digest
    assert info.relays == () and info.bootstrap_maddrs == []


def test_a_tampered_signed_answer_is_refused(real: tuple[Coordinator, str]) -> None:
    core, address = real

    def tamper(answer: pb.JoinResponse) -> pb.JoinResponse:
        body = pb.JoinAnswerBody()
        body.ParseFromString(answer.signed_answer.body)
        body.answer.relays[:] = [EVIL_RELAY]
        answer.signed_answer.body = body.SerializeToString()
        return answer

    server, front, _ = _through(address, tamper)
    try:
        with pytest.raises(CoordinatorIdentityError, match="signature does not hold"):
            _client(front, coordinator_key=core.identity.public_key).join()
        with pytest.raises(CoordinatorIdentityError, match="signature does not hold"):
            _client(front).join()  # nothing pinned: still no tampered answer
    finally:
        server.stop(None)


def test_a_replayed_or_unsigned_answer_is_refused(real: tuple[Coordinator, str]) -> None:
    core, address = real
    replayed: list[pb.JoinResponse] = []

    def replay(answer: pb.JoinResponse) -> pb.JoinResponse:
        replayed.append(answer)
        return replayed[0]  # always the first answer this impostor saw

    server, front, _ = _through(address, replay)
    try:
        _client(front, coordinator_key=core.identity.public_key).join()  # the first one is genuine
        with pytest.raises(CoordinatorIdentityError, match="another request"):
            _client(front, coordinator_key=core.identity.public_key).join()
    finally:
        server.stop(None)

    def unsign(answer: pb.JoinResponse) -> pb.JoinResponse:
        answer.ClearField("signed_answer")
        return answer

    server, front, _ = _through(address, unsign)
    try:
        with pytest.raises(CoordinatorIdentityError, match="unsigned"):
            _client(front).join()
    finally:
        server.stop(None)


def test_a_damaged_pins_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / PINS_FILE).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="delete it"):
        PinnedKeys(tmp_path).expected("h:1")
    (tmp_path / PINS_FILE).write_text('{"h:1": "not-a-key"}')
    with pytest.raises(ConfigError, match="not a public id"):
        PinnedKeys(tmp_path).expected("h:1")
    assert PinnedKeys(None).expected("h:1") is None
