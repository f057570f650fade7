"""The WAN simulator's delay element, pure parts (no root, no TAPs): validation, the delay queue, the forwarder."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from benchmarks import netsim
from benchmarks.delay_link import MAX_DELAY_MS, DelayQueue, Forwarder, start_delay_link, validate_delay_ms
from benchmarks.netsim import NotRootError, WanSim

# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("value, ms", [(0, 0.0), (40, 40.0), (12.5, 12.5), (MAX_DELAY_MS, MAX_DELAY_MS)])
def test_valid_delays(value: float, ms: float) -> None:
    assert validate_delay_ms(value) == ms


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "must not be negative"),
        (-0.001, "must not be negative"),
        (math.nan, "must be finite"),
        (math.inf, "must be finite"),
        (-math.inf, "must be finite"),
        (MAX_DELAY_MS + 1, "at most"),
        ("40", "expected a number"),
        (True, "expected a number"),
        (None, "expected a number"),
    ],
)
def test_bad_delays_are_refused_clearly(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_delay_ms(value)


def test_delay_arguments_are_validated_before_the_root_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="invalid delay_ms -5: must not be negative"):
        WanSim(hosts=["a", "b"], delay_ms=-5)
    with pytest.raises(ValueError, match="must be finite"):
        WanSim(hosts=["a", "b"], delay_ms=math.nan)
    with pytest.raises(ValueError, match=r"delays given for unknown hosts \['c'\]"):
        WanSim(hosts=["a", "b"], delays={"c": 10})
    with pytest.raises(ValueError, match="delay for host 'b'.*must not be negative"):
        WanSim(hosts=["a", "b"], delays={"b": -1})
    with pytest.raises(ValueError, match="delay for host 'a'.*must be finite"):
        WanSim(hosts=["a", "b"], delays={"a": math.inf})
    with pytest.raises(NotRootError):  # valid delays: the next check is the root one
        WanSim(hosts=["a", "b"], delay_ms=20, delays={"a": 0})


def test_delays_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netsim, "_find_tool", lambda name, package="iproute2": name)
    sim = WanSim(hosts=["a", "b", "c"], delay_ms=20, delays={"b": 0, "c": 7.5})
    assert sim.delays_ms == {"a": 20.0, "b": 0.0, "c": 7.5}
    assert WanSim(hosts=["a", "b"]).delays_ms == {"a": 0.0, "b": 0.0}  # the default: plain veths


def test_start_delay_link_validates_before_touching_the_system() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        start_delay_link(netns="nowhere", host_tap="x", bridge_tap="y", delay_ms=-1)
    with pytest.raises(ValueError, match="tick_ms"):
        start_delay_link(netns="nowhere", host_tap="x", bridge_tap="y", delay_ms=1, tick_ms=math.nan)


# --------------------------------------------------------------------------- the delay queue


def test_frames_are_released_after_the_delay_in_order() -> None:
    q = DelayQueue(0.040)
    assert q.next_release() is None and q.pop_due(1e9) == []
    q.push(b"1", 10.000)
    q.push(b"2", 10.005)
    q.push(b"3", 10.005)
    assert len(q) == 3 and q.queued_bytes == 3
    assert q.next_release() == pytest.approx(10.040)
    assert q.pop_due(10.039) == []
    assert q.pop_due(10.040) == [b"1"]
    assert q.next_release() == pytest.approx(10.045)
    assert q.pop_due(11.0) == [b"2", b"3"]
    assert len(q) == 0 and q.queued_bytes == 0 and q.next_release() is None


def test_release_times_never_go_backwards() -> None:
    q = DelayQueue(0.010)
    q.push(b"late clock", 5.0)
    q.push(b"earlier stamp", 4.0)  # stamped before the one ahead of it: still released after it
    assert q.next_release() == pytest.approx(5.010)
    assert q.pop_due(4.5) == []
    assert q.pop_due(5.010) == [b"late clock", b"earlier stamp"]


def test_zero_delay_releases_at_once() -> None:
    q = DelayQueue(0.0)
    q.push(b"x", 1.0)
    assert q.pop_due(1.0) == [b"x"]


def test_a_full_queue_drops_at_the_tail() -> None:
    q = DelayQueue(1.0, max_bytes=10)
    assert q.push(b"12345", 0.0)
    assert q.push(b"67890", 0.0)
    assert not q.push(b"!", 0.0)
    assert q.dropped == 1 and len(q) == 2
    assert q.pop_due(1.0) == [b"12345", b"67890"]
    assert q.push(b"!", 2.0)  # room again


@pytest.mark.parametrize("delay", [-0.1, math.nan, math.inf])
def test_delay_queue_refuses_bad_delays(delay: float) -> None:
    with pytest.raises(ValueError, match="invalid delay"):
        DelayQueue(delay)


def test_delay_queue_refuses_a_bad_size() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        DelayQueue(0.0, max_bytes=0)


# --------------------------------------------------------------------------- the forwarder


@pytest.fixture
def wire() -> Iterator[tuple[socket.socket, socket.socket, socket.socket, socket.socket]]:
    """(side a, forwarder's a end, forwarder's b end, side b): two frame-keeping socket pairs."""
    a, fa = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fb, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, fa, fb, b
    for s in (a, fa, fb, b):
        s.close()


def _recv_n(sock: socket.socket, n: int, timeout: float = 2.0) -> list[tuple[float, bytes]]:
    sock.settimeout(timeout)
    out: list[tuple[float, bytes]] = []
    for _ in range(n):
        frame = sock.recv(70_000)
        out.append((time.monotonic(), frame))
    return out


@pytest.mark.parametrize("tick_s, slack_s", [(0.0, 0.0), (0.001, 0.0005)])
def test_forwarder_delays_both_directions_and_keeps_order(
    wire: tuple[socket.socket, socket.socket, socket.socket, socket.socket], tick_s: float, slack_s: float
) -> None:
    a, fa, fb, b = wire
    delay = 0.030
    fwd = Forwarder(fa.fileno(), fb.fileno(), delay, tick_s=tick_s, slack_s=slack_s)
    runner = threading.Thread(target=fwd.run, kwargs={"deadline": time.monotonic() + 2.0})
    runner.start()
    try:
        sent = time.monotonic()
        for i in range(5):
            a.send(b"a%d" % i * (i + 1) * 100)
        b.send(b"from b")
        to_b, to_a = _recv_n(b, 5), _recv_n(a, 1)
    finally:
        a.close()  # end of file on one side stops the forwarder
        runner.join(timeout=2.0)
    assert not runner.is_alive()
    assert [frame for _, frame in to_b] == [b"a%d" % i * (i + 1) * 100 for i in range(5)]
    assert to_a[0][1] == b"from b"
    earliest = delay - slack_s - tick_s / 2  # the documented precision
    for t, _ in to_b + to_a:
        assert t - sent >= earliest - 1e-4
        assert t - sent < delay + 1.0  # generous: the machine may be busy
    assert fwd.a_to_b.frames == 5 and fwd.b_to_a.frames == 1
    assert fwd.a_to_b.bytes == sum((i + 1) * 100 * 2 for i in range(5))
    assert fwd.a_to_b.max_frame == 1000 and fwd.a_to_b.write_errors == 0


def test_forwarder_stops_at_its_deadline(
    wire: tuple[socket.socket, socket.socket, socket.socket, socket.socket],
) -> None:
    _, fa, fb, _ = wire
    t0 = time.monotonic()
    Forwarder(fa.fileno(), fb.fileno(), 0.01).run(deadline=t0 + 0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0


def test_forwarder_refuses_bad_timing_settings() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        Forwarder(0, 1, 0.01, tick_s=-1.0)
    with pytest.raises(ValueError, match="slack_s"):
        Forwarder(0, 1, 0.01, slack_s=math.nan)
