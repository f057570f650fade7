"""The port a peer picks for its daemon (and a node for its ranks' store) lies where the kernel
never hands one out: one CI run lost a peer whose greeter let go of an ephemeral port that
another listener bound to 0 took before the libp2p daemon could ("bind: address already in use")."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from peer.net.network_path import Coordinated, choose_path
from protocol import coordinator_pb2 as pb
from protocol.ports import ephemeral_range, quiet_ports, unassigned_port


class ReachedStub:
    """A coordinator that dials back and finds the greeter (records the port it was asked for)."""

    def __init__(self) -> None:
        self.ports: list[int] = []

    def Probe(self, request: pb.ProbeRequest, timeout: float) -> pb.ProbeResponse:
        self.ports.append(request.dial_back_port)
        return pb.ProbeResponse(observed_host="203.0.113.7", dialed=True, dial_matched=True)


needs_a_quiet_range = pytest.mark.skipif(
    not quiet_ports(), reason="the kernel's ephemeral range covers every port: the kernel picks one"
)


def outside_ephemeral(port: int) -> bool:
    low, high = ephemeral_range()
    return port < low or port > high


@needs_a_quiet_range
def test_a_peer_without_a_port_flag_listens_outside_the_ephemeral_range() -> None:
    stub = ReachedStub()
    coordinated = Coordinated("127.0.0.1:1", stub, 0, token=lambda: b"", sign=lambda data: b"")
    path = choose_path(client_mode=False, announce=None, port=0, env={}, coordinated=coordinated)
    assert path.kind == "direct" and stub.ports == [path.port]
    assert outside_ephemeral(path.port), path.port


@needs_a_quiet_range
def test_listeners_bound_to_zero_are_never_given_the_picked_port() -> None:
    picked = [unassigned_port() for _ in range(20)]
    assert all(outside_ephemeral(port) for port in picked)
    held = []
    try:
        for _ in range(200):  # what other programs' listeners get meanwhile
            sock = socket.socket()
            sock.bind(("", 0))
            held.append(sock)
        assert not {sock.getsockname()[1] for sock in held} & set(picked)
    finally:
        for sock in held:
            sock.close()


@needs_a_quiet_range
def test_a_taken_port_is_skipped(tmp_path: Path) -> None:
    first = unassigned_port(rng=random.Random(7))
    with socket.socket() as taken:
        taken.bind(("", first))
        taken.listen()
        assert unassigned_port(rng=random.Random(7)) != first
    ranges = tmp_path / "range"
    ranges.write_text("10002\t60999\n")  # the gap below holds two ports, the one above thousands
    assert quiet_ports(ranges) == range(61_000, 65_536)


def test_an_unreadable_range_falls_back_to_linuxs_default(tmp_path: Path) -> None:
    assert ephemeral_range(tmp_path / "absent") == (32_768, 60_999)
    assert quiet_ports(tmp_path / "absent") == range(10_000, 32_768)
