"""The coordinator's answer to `swarmtrain doctor` (``coordinator.probe``): bounded fields,
a per-source budget, and a dial-back only to the caller's own address."""

from __future__ import annotations

import socket
import threading

import pytest

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


def test_the_dial_back_reads_what_the_callers_port_serves() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"hello " * 20)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        answer = prober().answer(pb.ProbeRequest(dial_back_port=port), source="127.0.0.1")
    finally:
        thread.join(timeout=5)
        server.close()
    assert answer.dialed and answer.dial_error == ""
    assert answer.dial_greeting == (b"hello " * 20)[:GREETING_BYTES]


def test_a_closed_port_or_a_host_name_is_reported_not_raised() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = s.getsockname()[1]
    answer = prober().answer(pb.ProbeRequest(dial_back_port=closed), source="127.0.0.1")
    assert answer.dialed and "127.0.0.1:" in answer.dial_error and not answer.dial_greeting
    named = prober().answer(pb.ProbeRequest(dial_back_port=80), source="unix:/tmp/x")
    assert "not an IP address" in named.dial_error
