"""``engine.process_signals``: starting the averager never makes the peer deaf to Ctrl-C (it was
for the seconds hivemind's averager took to get ready: a leave asked then never came)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from engine.process_signals import OwnSignals


class _Process:
    """hivemind's side, standing in: records the SIGINT handler at each step."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def start(self) -> None:
        self.seen.append(("start", signal.getsignal(signal.SIGINT)))

    def wait_until_ready(self, timeout: float | None = None) -> None:
        self.seen.append(("ready", signal.getsignal(signal.SIGINT)))

    def run(self) -> None:
        self.seen.append(("run", signal.getsignal(signal.SIGINT)))


class _Averager(OwnSignals, _Process):
    pass


def _handler(signum: int, frame: object) -> None:
    pass


@pytest.fixture
def handler() -> Iterator[Any]:
    before = signal.signal(signal.SIGINT, _handler)
    try:
        yield _handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_starting_process_keeps_its_handler_while_the_averager_gets_ready(handler: Any) -> None:
    averager = _Averager()
    averager.run_in_background(await_ready=True, timeout=1.0)
    assert averager.seen == [("start", handler), ("ready", handler)]
    assert signal.getsignal(signal.SIGINT) is handler


def test_the_averager_process_ignores_sigint_itself(handler: Any) -> None:
    averager = _Averager()
    averager.run()  # (here in this process: what the forked child runs first)
    assert averager.seen == [("run", signal.SIG_IGN)]
