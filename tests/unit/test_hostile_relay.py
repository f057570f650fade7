"""A volunteer's relay is a stranger's program: what one that lies can make a relayed peer do
(``peer.net.relay_client``, ``peer.net.hole_punch``). Each test runs a hostile relay on loopback, speaking
the relay wire to a real ``RelayTunnel``: a flood of ``Incoming`` takes at most the tunnel's caps
of connections and descriptors; a ``PunchGo`` naming another host than its call, or an address
more local than the relay, is refused before any connect; a punch tries at most
``MAX_ATTEMPTS`` connects; a flood of ``PunchCall`` is answered a few at a time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator

import pytest

import peer.net.hole_punch as hole_punch
import peer.net.relay_client as relay_client
from peer.net.hole_punch import MAX_ATTEMPTS, PunchError, check_target, simultaneous_open
from peer.net.relay_client import RelayAddress, RelayTunnel
from relay.wire import (
    Granted,
    Incoming,
    Message,
    Open,
    PunchAnswer,
    PunchCall,
    PunchGo,
    Take,
    encode,
    read_message,
)
from swarmtrain.localswarm import wait_until
from tests.unit.relay_keys import signer

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Message], Awaitable[None]]


class HostileRelay:
    """A relay on loopback that grants a port to whoever opens, then runs ``control(reader,
    writer)`` on that control connection; other connections (``Take``, ``PunchAnswer``) go to
    ``other(reader, writer, first message)`` and are held open until the relay stops."""

    def __init__(self, control: Callable[[asyncio.StreamWriter], Awaitable[None]], other: Serve) -> None:
        self.control, self.other = control, other
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result(5)
        self.port = int(self.server.sockets[0].getsockname()[1])
        self.writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        first = await read_message(reader)
        if isinstance(first, Open):
            writer.write(encode(Granted(40000)))
            await self.control(writer)
        else:
            await self.other(reader, writer, first)
        await asyncio.sleep(3600)  # held open

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for writer in self.writers:
                writer.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Daemon:
    """Stands for the peer's libp2p daemon: accepts and holds connections, counting them."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                self.accepted.append(self.server.accept()[0])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()
        for conn in self.accepted:
            conn.close()


@contextlib.contextmanager
def tunnel_to(relay: HostileRelay, *, answer_punches: bool = False) -> Iterator[tuple[RelayTunnel, Daemon]]:
    daemon = Daemon()
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", relay.port),
        token=lambda: b"token",
        sign=signer(b"token"),
        local_port=daemon.port,
        answer_punches=answer_punches,
    )
    try:
        assert tunnel.open() == 40000
        yield tunnel, daemon
    finally:
        tunnel.close()
        daemon.close()
        relay.stop()


def test_a_flood_of_incoming_connections_takes_at_most_the_tunnels_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """700 ``Incoming`` in quick waves, each ``Take`` held open by the relay: the tunnel carries at
    most ``MAX_SPLICED`` of them, taking ``MAX_TAKING`` at a time (700 tasks and 1,400
    descriptors before the caps)."""
    monkeypatch.setattr(relay_client, "MAX_TAKING", 4)
    monkeypatch.setattr(relay_client, "MAX_SPLICED", 12)
    taken: list[int] = []

    async def flood(writer: asyncio.StreamWriter) -> None:
        for conn_id in range(700):
            writer.write(encode(Incoming(conn_id, "203.0.113.9", 4000 + conn_id)))
            if conn_id % 10 == 9:
                await writer.drain()
                await asyncio.sleep(0.02)  # takes complete between the waves

    async def take(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter, first: Message) -> None:
        assert isinstance(first, Take)
        taken.append(first.conn_id)

    with tunnel_to(HostileRelay(flood, take)) as (tunnel, daemon):
        # every Incoming read, and every take it started done: nothing more can start
        wait_until(lambda: tunnel.ignored + tunnel.connections >= 700, 20, what="every Incoming read")
        wait_until(lambda: tunnel._taking == 0 and len(taken) == tunnel.connections, 10, what="the takes to end")
        assert len(taken) == 12 and len(daemon.accepted) == 12
        assert tunnel.ignored == 700 - 12


def test_a_punch_go_naming_another_host_than_its_call_is_refused_before_any_connect() -> None:
    """The relay calls for a punch from one host, then names another (a reflector into anyone's
    network): the holder connects nowhere."""
    victim = Daemon()  # where the relay wants the peer to connect
    answers: list[int] = []

    async def call(writer: asyncio.StreamWriter) -> None:
        writer.write(encode(PunchCall(7, "127.0.0.2", 5555)))

    async def go(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: Message) -> None:
        assert isinstance(first, PunchAnswer)
        answers.append(first.punch_id)
        writer.write(encode(PunchGo("127.0.0.1", victim.port)))

    try:
        with tunnel_to(HostileRelay(call, go), answer_punches=True) as (tunnel, _daemon):
            wait_until(lambda: answers == [7], 10, what="the holder's answer")
            wait_until(lambda: tunnel._answering == 0, 10, what="the holder to give the punch up")
            assert tunnel.punched == 0
        assert victim.accepted == []
    finally:
        victim.close()


@pytest.mark.parametrize(
    ("relay_host", "target", "refused"),
    [
        ("93.184.216.34", "127.0.0.1", True),  # a public relay names this machine
        ("93.184.216.34", "192.168.1.1", True),  # ... the volunteer's LAN (its router)
        ("93.184.216.34", "169.254.169.254", True),  # ... a cloud's metadata service
        ("93.184.216.34", "0.0.0.0", True),
        ("93.184.216.34", "224.0.0.1", True),
        ("93.184.216.34", "::1", True),
        ("93.184.216.34", "1.1.1.1", False),  # another public address: a NAT'ed peer's
        ("10.79.1.2", "10.79.1.5", False),  # a relay on the LAN names a host there
        ("10.79.1.2", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.1", False),  # a relay on this machine
    ],
)
def test_a_punch_target_is_never_more_local_than_the_relay(relay_host: str, target: str, refused: bool) -> None:
    if refused:
        with pytest.raises(PunchError, match="refused"):
            check_target(relay_host, target, 7700)
    else:
        check_target(relay_host, target, 7700)


def test_a_punch_tries_a_bounded_number_of_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target that answers every SYN with a reset (a closed port): the punch stops after
    ``MAX_ATTEMPTS`` connects (about 100 in its 6 s before)."""
    monkeypatch.setattr(hole_punch, "RETRY_PAUSE_S", (0.001, 0.002))
    tries: list[int] = []
    bound = hole_punch._bound

    def counting(port: int) -> socket.socket:
        tries.append(port)
        return bound(port)

    monkeypatch.setattr(hole_punch, "_bound", counting)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(PunchError, match=f"in {MAX_ATTEMPTS} tries"):
        asyncio.run(simultaneous_open(0, "127.0.0.1", port, within_s=6.0))
    assert len(tries) == MAX_ATTEMPTS


def test_a_flood_of_punch_calls_is_answered_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """100 ``PunchCall`` at once, their rendezvous never answered: the holder works on at most
    ``MAX_ANSWERING`` of them."""
    answering: list[int] = []

    async def calls(writer: asyncio.StreamWriter) -> None:
        for punch_id in range(100):
            writer.write(encode(PunchCall(punch_id, "127.0.0.1", 5555)))
        await writer.drain()

    async def stall(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter, first: Message) -> None:
        assert isinstance(first, PunchAnswer)
        answering.append(first.punch_id)  # and never sends PunchGo

    with tunnel_to(HostileRelay(calls, stall), answer_punches=True) as (tunnel, _daemon):
        # the answered punches never end (no PunchGo comes), so every other call was ignored
        wait_until(lambda: tunnel.ignored == 100 - relay_client.MAX_ANSWERING, 20, what="every call read")
        wait_until(lambda: len(answering) == relay_client.MAX_ANSWERING, 10, what="the answers to reach the relay")
        assert tunnel._answering == relay_client.MAX_ANSWERING
        assert tunnel.ignored == 100 - relay_client.MAX_ANSWERING
