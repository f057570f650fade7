"""Hole punching's rendezvous at a relay (``relay.server``, ``peer.net.hole_punch``): each
side learns where the other's fresh socket comes from; a punch the relay cannot place is
refused and changes nothing; a relay tunnel takes no relayed connection from a host it reaches
over a punched one; and the puncher picks only connections at a relay's port. (The simultaneous
open itself needs two NATs: ``tests/integration/test_nat.py``.)"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import peer.net.relay_client as relay_client
import relay.server as relay_server
from peer.net.hole_punch import DirectPaths, NotRelayed, PunchError, _rendezvous
from peer.net.puncher import relay_target, relays_by_ip
from peer.net.relay_client import RelayAddress, RelayTunnel
from relay.server import Relay
from relay.wire import (
    OPENING,
    Challenge,
    Granted,
    Open,
    PunchAnswer,
    PunchAsk,
    PunchCall,
    PunchGo,
    encode,
    prove,
    read_message,
)
from swarmtrain.localswarm import wait_until
from tests.ports import free_ports
from tests.unit.relay_keys import signer, stand_in_relay


@pytest.fixture
def relay() -> Iterator[Relay]:
    with stand_in_relay(free_ports(2)) as served:
        yield served


async def _hold(relay: Relay, token: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A peer's control connection holding a port (on the raw wire: it answers nothing itself)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.control_port)
    writer.write(encode(Open(token)))
    challenge = await read_message(reader)
    assert isinstance(challenge, Challenge)
    writer.write(encode(prove(challenge, OPENING, token, signer(token))))
    granted = await read_message(reader)
    assert isinstance(granted, Granted)
    return reader, writer, granted.port


def test_each_side_of_a_punch_learns_where_the_others_fresh_socket_comes_from(relay: Relay) -> None:
    async def go() -> None:
        reader, writer, port = await _hold(relay, b"ok-b")
        asking = asyncio.ensure_future(
            _rendezvous(("127.0.0.1", relay.control_port), PunchAsk(b"ok-a", port), signer(b"ok-a"))
        )
        call = await asyncio.wait_for(read_message(reader), 5)
        assert isinstance(call, PunchCall) and call.host == "127.0.0.1"
        local_b, go_b = await _rendezvous(("127.0.0.1", relay.control_port), PunchAnswer(call.punch_id))
        local_a, go_a = await asyncio.wait_for(asking, 5)
        assert call.port == local_a  # no NAT here: the relay sees the socket's own port
        assert go_b == PunchGo("127.0.0.1", local_a)
        assert go_a == PunchGo("127.0.0.1", local_b)
        assert local_a != local_b
        writer.close()

    asyncio.run(go())
    # the relay counts the punch in its own thread once its PunchGo to the asker is flushed,
    # which may come after the asker has read it
    wait_until(lambda: relay.punches == 1, 30, "the relay to count the punch")
    assert relay.punches == 1


def test_punches_the_relay_cannot_place_are_refused(relay: Relay) -> None:
    async def go() -> None:
        _, writer, port = await _hold(relay, b"ok-b")
        where = ("127.0.0.1", relay.control_port)
        with pytest.raises(NotRelayed, match="nobody holds that port"):
            await _rendezvous(where, PunchAsk(b"ok-a", free_ports(1)[0]), signer(b"ok-a"))
        with pytest.raises(PunchError, match="not a valid access token"):
            await _rendezvous(where, PunchAsk(b"bad", port), signer(b"bad"))
        with pytest.raises(PunchError, match="cannot punch through to itself"):
            await _rendezvous(where, PunchAsk(b"ok-b", port), signer(b"ok-b"))
        with pytest.raises(PunchError):  # nobody asked for it: the relay closes without a word
            await _rendezvous(where, PunchAnswer(12345))
        writer.close()

    asyncio.run(go())
    assert relay.punches == 0


def test_a_holder_that_does_not_answer_fails_the_punch_in_time(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_server, "PUNCH_ANSWER_S", 0.3)

    async def go() -> None:
        _, writer, port = await _hold(relay, b"ok-b")
        with pytest.raises(PunchError, match="did not answer"):
            await _rendezvous(("127.0.0.1", relay.control_port), PunchAsk(b"ok-a", port), signer(b"ok-a"))
        writer.close()

    asyncio.run(go())


def test_a_peer_that_did_not_opt_in_answers_no_punch(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_server, "PUNCH_ANSWER_S", 0.5)
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", relay.control_port), token=lambda: b"ok-b", sign=signer(b"ok-b"), local_port=1
    )
    try:
        port = tunnel.open()
        with pytest.raises(PunchError, match="did not answer"):
            asyncio.run(_rendezvous(("127.0.0.1", relay.control_port), PunchAsk(b"ok-a", port), signer(b"ok-a")))
        assert tunnel.punched == 0
    finally:
        tunnel.close()


def test_direct_paths_count_each_holder() -> None:
    direct = DirectPaths()
    with direct.held("198.51.100.4"):
        with direct.held("198.51.100.4"):
            assert "198.51.100.4" in direct
        assert "198.51.100.4" in direct
    assert "198.51.100.4" not in direct


def _through(port: int) -> bytes:
    """What a connection to a relay port gets back for b"ping" (b"" when it was not taken)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"ping")
        conn.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := conn.recv(1 << 16):
            got += chunk
        return got


def test_a_tunnel_takes_a_relayed_connection_from_a_host_it_reaches_directly_late(
    relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_client, "DEFER_S", 0.5)
    daemon = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for _ in range(2):
            conn, _ = daemon.accept()
            with conn:
                conn.sendall(conn.recv(4).upper())

    direct = DirectPaths()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", relay.control_port),
        token=lambda: b"ok-b",
        sign=signer(b"ok-b"),
        local_port=daemon.getsockname()[1],
        direct=direct,
    )
    try:
        port = tunnel.open()
        threading.Thread(target=serve, daemon=True).start()
        assert _through(port) == b"PING"  # relayed, as any
        with direct.held("127.0.0.1"):
            # punched: the relayed dial loses the race to the punched one, but never fails
            # (a failed dial would put the relay's address in libp2p's dial backoff)
            start = time.monotonic()
            assert _through(port) == b"PING"
            assert time.monotonic() - start >= relay_client.DEFER_S
        assert tunnel.connections == 2
    finally:
        tunnel.close()
        daemon.close()


@pytest.mark.parametrize(
    ("maddr", "expected"),
    [
        ("/ip4/203.0.113.1/tcp/7803", ("203.0.113.1", (7800, 7900), 7803)),
        ("/ip4/203.0.113.1/tcp/7800", None),  # a relay's control port is nobody's address
        ("/ip4/203.0.113.1/tcp/7900", None),
        ("/ip4/198.51.100.9/tcp/7803", None),  # no relay this peer knows of
        ("/ip4/203.0.113.1/udp/7803/quic", None),
        ("/ip4/127.0.0.1/tcp/41000", None),  # a connection that came through this peer's own tunnel
        ("/p2p-circuit", None),
    ],
)
def test_the_puncher_asks_only_for_connections_at_a_relays_port(
    maddr: str, expected: tuple[str, tuple[int, ...], int] | None
) -> None:
    assert relay_target(maddr, {"203.0.113.1": (7800, 7900)}) == expected


def test_relays_are_known_by_ip_with_every_control_port_on_a_host() -> None:
    listed = [("127.0.0.1", 7800), ("localhost", 7900), ("127.0.0.1", 7800), ("no-such-host.invalid", 7800)]
    assert relays_by_ip(listed) == {"127.0.0.1": (7800, 7900)}  # a name is resolved; one that is not, left out


def test_one_peer_cannot_keep_every_punch_slot(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_server, "PUNCH_ANSWER_S", 1.0)

    async def go() -> None:
        _, writer, port = await _hold(relay, b"ok-b")  # holds a port and never answers
        where = ("127.0.0.1", relay.control_port)
        waiting = [
            asyncio.ensure_future(_rendezvous(where, PunchAsk(b"ok-a", port), signer(b"ok-a"))) for _ in range(4)
        ]
        await asyncio.sleep(0.3)
        with pytest.raises(PunchError, match="too many punches of this peer"):
            await _rendezvous(where, PunchAsk(b"ok-c", port), signer(b"ok-c"))  # another asker, the same holder
        for outcome in await asyncio.gather(*waiting, return_exceptions=True):
            assert isinstance(outcome, PunchError) and "did not answer" in str(outcome)
        writer.close()

    asyncio.run(go())
