"""A stranger who read every access token in the run's DHT, against a relay on loopback with the
run's real admission (``run_token_admission``, tokens signed by the coordinator): a token alone
opens nothing, since the relay wants proof of the key it names (``relay.wire.Challenge``).
The stranger gets 0 connections meant for a member, 0 ports, and no member's address."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from peer.net.relay_client import RelayAddress, RelayError, RelayTunnel
from protocol.identity import Identity
from protocol.tokens import issue_token
from relay.server import Relay, run_token_admission
from relay.wire import (
    OPENING,
    PUNCHING,
    Challenge,
    Granted,
    Incoming,
    Message,
    Open,
    PunchAsk,
    PunchCall,
    Refused,
    encode,
    prove,
    read_message,
)
from swarmtrain.localswarm import wait_until
from tests.ports import free_ports

RUN = "sha256:run"


@dataclass
class Run:
    coordinator: Identity
    relay: Relay

    def member(self) -> tuple[Identity, bytes]:
        """A new admitted peer: its key and the token the coordinator gave it (public: it is in the DHT)."""
        peer = Identity.generate()
        token = issue_token(self.coordinator, run_digest=RUN, peer_key=peer.public_key, now=time.time(), ttl_s=600)
        return peer, token.to_bytes()


@pytest.fixture
def run() -> Iterator[Run]:
    coordinator = Identity.generate()
    admit = run_token_admission(coordinator_key=coordinator.public_key, run_digest=RUN)
    relay = Relay(host="127.0.0.1", control_port=0, ports=free_ports(2), admit=admit)
    relay.control_port = relay.start()
    yield Run(coordinator, relay)
    relay.stop()


class _Listener:
    """The member's daemon: counts the connections that reach it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


async def _stranger(relay: Relay, first: Message, *, proof_key: Identity | None, purpose: str) -> list[Message]:
    """What a stranger reads back after sending ``first`` (a member's token) and, when
    challenged, a proof signed with ``proof_key`` (its own key: it has no other), for 2 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.control_port)
    writer.write(encode(first))
    got: list[Message] = []
    try:
        while True:
            message = await asyncio.wait_for(read_message(reader), 2.0)
            got.append(message)
            if isinstance(message, Challenge) and proof_key is not None:
                token = first.token if isinstance(first, Open | PunchAsk) else b""
                writer.write(encode(prove(message, purpose, token, proof_key.sign)))
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
    return got


def test_a_stolen_token_does_not_take_a_members_port_or_its_connections(run: Run) -> None:
    member, token = run.member()
    daemon = _Listener()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", run.relay.control_port), token=lambda: token, sign=member.sign, local_port=daemon.port
    )
    try:
        port = tunnel.open()
        held = run.relay._by_peer[member.public_key.id]
        control = held.control
        thief = Identity.generate()
        for proof_key in (None, thief):  # no proof at all; a proof with the stranger's own key
            got = asyncio.run(_stranger(run.relay, Open(token), proof_key=proof_key, purpose=OPENING))
            assert not any(isinstance(m, Granted | Incoming) for m in got), got
            if proof_key is not None:
                assert isinstance(got[-1], Refused) and "no proof" in got[-1].reason
        assert held.control is control  # the member's control connection was never replaced
        for _ in range(30):  # dials to the member's relayed address reach the member
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        wait_until(lambda: daemon.accepted == 30, 10, "every dial at the member")
    finally:
        tunnel.close()
        daemon.close()


def test_members_tokens_do_not_fill_the_relays_ports(run: Run) -> None:
    """The relay has 2 ports; a stranger with two members' tokens gets neither, and an admitted
    newcomer then gets one."""
    for _ in range(2):
        _member, token = run.member()
        got = asyncio.run(_stranger(run.relay, Open(token), proof_key=Identity.generate(), purpose=OPENING))
        assert not any(isinstance(m, Granted) for m in got)
    assert run.relay.stats().peers == 0
    newcomer, token = run.member()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", run.relay.control_port), token=lambda: token, sign=newcomer.sign, local_port=1
    )
    try:
        assert tunnel.open() > 0
    finally:
        tunnel.close()


def test_a_punch_asked_with_a_stolen_token_learns_no_address(run: Run) -> None:
    """A ``PunchAsk`` answered with a holder's public address (the relay exists to hide it)
    needs proof of the asker's token; the holder is not even called."""
    holder, holder_token = run.member()
    _victim, victim_token = run.member()
    calls: list[Message] = []

    class Counting(RelayTunnel):
        async def _answer(self, call: PunchCall) -> None:
            calls.append(call)

    tunnel = Counting(
        RelayAddress("127.0.0.1", run.relay.control_port),
        token=lambda: holder_token,
        sign=holder.sign,
        local_port=1,
        answer_punches=True,
    )
    try:
        port = tunnel.open()
        for proof_key in (None, Identity.generate()):
            got = asyncio.run(_stranger(run.relay, PunchAsk(victim_token, port), proof_key=proof_key, purpose=PUNCHING))
            assert all(isinstance(m, Challenge | Refused) for m in got), got
        # each stranger's connection was refused and closed before any call (the relay calls a
        # holder only after the proof, and reads it for 2 s in ``_stranger``)
        assert calls == [] and run.relay.punches == 0 and run.relay._punches == {}
    finally:
        tunnel.close()


def test_a_proof_for_opening_is_no_proof_for_punching(run: Run) -> None:
    """A signature is bound to what it proves (and to the relay's fresh nonce)."""
    member, token = run.member()
    holder, holder_token = run.member()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", run.relay.control_port), token=lambda: holder_token, sign=holder.sign, local_port=1
    )
    try:
        port = tunnel.open()
        got = asyncio.run(_stranger(run.relay, PunchAsk(token, port), proof_key=member, purpose=OPENING))
        assert isinstance(got[-1], Refused) and "no proof" in got[-1].reason
    finally:
        tunnel.close()


def test_a_tunnel_without_the_tokens_key_is_refused_saying_why(run: Run) -> None:
    _member, token = run.member()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", run.relay.control_port),
        token=lambda: token,
        sign=Identity.generate().sign,
        local_port=1,
    )
    with pytest.raises(RelayError, match="no proof of the token's key"):
        tunnel.open()
