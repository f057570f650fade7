"""A real averager process started the peer's way: the peer's SIGINT handler is untouched while
it starts, and the averager's process ignores SIGINT (a terminal's Ctrl-C reaches the whole
process group; the peer stops its children in order) (``engine.process_signals``)."""

from __future__ import annotations

import signal
from pathlib import Path

from hivemind import DHT

from engine.averager import ExactAverager
from engine.codecs import get_codec

SIGINT_BIT = 1 << (signal.SIGINT - 1)


def _ignored(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)


def test_starting_the_averager_leaves_the_peers_handler_and_the_child_ignores_sigint() -> None:
    def handler(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGINT, handler)
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = ExactAverager(1000, dht, codec=get_codec("fp16"), prefix="signals", start=True)
        assert signal.getsignal(signal.SIGINT) is handler
        assert averager.pid is not None and _ignored(averager.pid) & SIGINT_BIT
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
        signal.signal(signal.SIGINT, before)
