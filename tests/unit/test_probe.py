"""The coordinator's answer to `swarmtrain doctor` (``coordinator.probe``): bounded fields,
a per-source budget, and a dial-back only to the caller's own address."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import pytest

from coordinator import probe
from coordinator.probe import GREETING_BYTES, PROBE_MAX_BYTES, PROBES_PER_MINUTE, ProbeLimitError, Prober
from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.version import __version__


def prober() -> Prober:
    return Prober(spec_toml="[run]\n", spec_digest="sha256:" + "0" * 64, bootstrap_maddrs=lambda: ["/ip4/1.2.3.4"])


def test_a_probe_tells_the_run_and_echoes_sizes() -> None:
    answer = prober().answer(pb.ProbeRequest(payload=b"x" * 1000, download_bytes=2000), source="10.0.0.7")
    assert answer.software_version == __version__ and answer.spec_toml == "[run]\n"
    assert answer.observed_host == "10.0.0.7" and answer.received_bytes == 1000 and len(answer.payload) == 2000
    assert not answer.dialed and answer.server_time > 0


@pytest.mark.parametrize(
    "request_",
    [
        pb.ProbeRequest(dial_back_port=70000),
        pb.ProbeRequest(dial_back_port=-1),
        pb.ProbeRequest(download_bytes=PROBE_MAX_BYTES + 1),
        pb.ProbeRequest(download_bytes=-5),
        pb.ProbeRequest(payload=bytes(PROBE_MAX_BYTES + 1)),
    ],
)
def test_out_of_range_fields_are_refused_and_cost_nothing(request_: pb.ProbeRequest) -> None:
    p = prober()
    with pytest.raises(MalformedMessageError):
        p.answer(request_, source="10.0.0.7")
    assert p.limiter.allow("10.0.0.7", 0.0)  # the bucket was not touched


def test_a_source_gets_a_bounded_number_of_probes() -> None:
    p = prober()
    answered = 0
    with pytest.raises(ProbeLimitError, match="probes a minute from 10.0.0.8"):
        for _ in range(PROBES_PER_MINUTE + 1):
            p.answer(pb.ProbeRequest(), source="10.0.0.8")
            answered += 1
    assert 0 < answered <= PROBES_PER_MINUTE
    p.answer(pb.ProbeRequest(), source="10.0.0.9")  # another source is not affected


class _Listener:
    """A TCP listener on loopback that serves each connection with ``serve(conn)`` on its own
    thread, counting connections; closed (and its threads joined) on exit."""

    def __init__(self, serve: Callable[[socket.socket], object]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self._serve, self._stop = serve, threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            with contextlib.suppress(OSError):
                self._serve(conn)

    def __enter__(self) -> _Listener:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()
        for thread in self._threads:
            thread.join(timeout=5)


GREETING = b"swarmtrain-dial-back 0123456789abcdef0123456789abcdef"


def _dial_back(p: Prober, port: int, expect: bytes = GREETING, source: str = "127.0.0.1") -> pb.ProbeResponse:
    return p.answer(pb.ProbeRequest(dial_back_port=port, dial_back_expect=expect), source=source)


def test_the_dial_back_tells_whether_the_callers_greeting_was_served() -> None:
    with _Listener(lambda conn: conn.sendall(GREETING)) as listener:
        answer = _dial_back(prober(), listener.port)
    assert answer.dialed and answer.dial_matched and answer.dial_error == ""
    assert answer.dial_greeting == b""  # nothing read is returned


def test_another_service_is_neither_matched_nor_shown() -> None:
    """A stranger behind a proxy that rewrites sources to loopback, probing the coordinator's
    host: the answer carries no byte of the service's banner, and does not tell an open port
    from a closed one."""
    banner = b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n"
    with _Listener(lambda conn: conn.sendall(banner)) as ssh:
        open_port = _dial_back(prober(), ssh.port, expect=b"x" * GREETING_BYTES)
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = s.getsockname()[1]
    closed_port = _dial_back(prober(), closed, expect=b"x" * GREETING_BYTES)
    for answer in (open_port, closed_port):
        assert answer.dialed and not answer.dial_matched and answer.dial_greeting == b""
        assert b"SSH" not in answer.SerializeToString()
    assert open_port.dial_error.replace(str(ssh.port), "P") == closed_port.dial_error.replace(str(closed), "P")


def test_a_listener_that_drips_bytes_holds_a_dial_back_no_longer_than_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One byte every 0.25 s: with a timeout per read it held a dial-back slot for 64 reads."""
    monkeypatch.setattr(probe, "DIAL_TIMEOUT_S", 0.5)

    def drip(conn: socket.socket) -> None:
        for byte in GREETING:
            conn.sendall(bytes([byte]))
            time.sleep(0.25)

    with _Listener(drip) as listener:
        started = time.monotonic()
        answer = _dial_back(prober(), listener.port)
        held = time.monotonic() - started
    assert not answer.dial_matched and "did not serve the caller's greeting" in answer.dial_error
    assert held < 0.5 + 1.0, held  # the deadline and the connect's own slack; 64 reads took ~16 s


def _hold_one_dial_back(p: Prober, source: str) -> tuple[threading.Thread, threading.Event, _Listener]:
    """Start a dial-back from ``source`` to a listener that sends nothing until released."""
    release = threading.Event()
    listener = _Listener(lambda conn: release.wait(10))
    thread = threading.Thread(target=_dial_back, args=(p, listener.port), kwargs={"source": source}, daemon=True)
    thread.start()
    end = time.monotonic() + 5
    while listener.accepted == 0 and time.monotonic() < end:
        time.sleep(0.01)
    assert listener.accepted == 1
    return thread, release, listener


def test_one_source_gets_one_dial_back_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source that holds a slot cannot take the others (8 in all) with more probes."""
    monkeypatch.setattr(probe, "DIAL_TIMEOUT_S", 5.0)
    p = prober()
    thread, release, listener = _hold_one_dial_back(p, "127.0.0.1")
    try:
        with socket.create_server(("127.0.0.1", 0)) as s:
            other_port = s.getsockname()[1]
        with pytest.raises(ProbeLimitError, match="one at a time per source"):
            _dial_back(p, other_port)
        # another source still gets its dial-back (a closed port: answered at once)
        assert _dial_back(p, other_port, source="127.0.0.2").dialed
    finally:
        release.set()
        thread.join(timeout=10)
        listener.__exit__()
    assert _dial_back(p, other_port).dialed  # the slot is free again


@pytest.mark.parametrize("expect", [b"", b"x" * (GREETING_BYTES + 1)], ids=["none", "too long"])
def test_a_dial_back_without_a_greeting_to_match_is_refused(expect: bytes) -> None:
    p = prober()
    with pytest.raises(MalformedMessageError, match="dial_back_expect"):
        _dial_back(p, 7700, expect=expect)
    assert p.limiter.allow("127.0.0.1", 0.0)  # the bucket was not touched


def test_an_unreachable_host_or_a_host_name_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "DIAL_TIMEOUT_S", 0.5)
    answer = _dial_back(prober(), 7700, source="192.0.2.1")  # TEST-NET-1: routed nowhere
    assert answer.dialed and not answer.dial_matched and "192.0.2.1:7700" in answer.dial_error
    named = _dial_back(prober(), 80, source="unix:/tmp/x")
    assert "not an IP address" in named.dial_error
