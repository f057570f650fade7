"""A peer started while its coordinator is down waits for it (``peer.link.coordinator_client.
join_when_up``): tries again with backoff (1, 2, 4, ... s, at most 30 s apart, jittered), says so
once, and says when it answered; a refusal is not retried. The real outage:
``tests/integration/test_coordinator_outage.py``."""

from __future__ import annotations

from typing import Any

import pytest

from peer.link.coordinator_client import (
    JOIN_BACKOFF_MAX_S,
    CoordinatorUnavailableError,
    JoinAs,
    join_when_up,
)
from protocol.errors import AdmissionError


class _Client:
    address = "coordinator.example:7500"

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0

    def join_as(self, who: JoinAs) -> Any:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "joined"


def test_it_waits_with_growing_pauses_and_says_so_twice() -> None:
    client = _Client([CoordinatorUnavailableError("UNAVAILABLE")] * 9)
    pauses: list[float] = []
    said: list[str] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    info = join_when_up(client, JoinAs(), say=said.append, sleep=sleep, clock=lambda: now[0], jitter=lambda: 1.0)  # type: ignore[arg-type]
    assert info == "joined" and client.calls == 10
    assert pauses == [1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert len(said) == 2 and "not answering" in said[0] and "Ctrl-C" in said[0]
    assert said[1] == f"coordinator {client.address} answered after 151 s"
    assert max(pauses) == JOIN_BACKOFF_MAX_S


def test_a_refusal_is_not_retried_and_an_answer_at_once_says_nothing() -> None:
    said: list[str] = []
    with pytest.raises(AdmissionError):
        join_when_up(_Client([AdmissionError("not on the allowlist")]), JoinAs(), say=said.append, sleep=lambda s: None)  # type: ignore[arg-type]
    assert join_when_up(_Client([]), JoinAs(), say=said.append, sleep=lambda s: None) == "joined"  # type: ignore[arg-type]
    assert said == []


def test_the_pauses_are_jittered_so_a_restart_is_not_met_by_everyone_at_once() -> None:
    pauses: list[float] = []
    client = _Client([CoordinatorUnavailableError("UNAVAILABLE")] * 3)
    join_when_up(client, JoinAs(), say=lambda line: None, sleep=pauses.append)  # type: ignore[arg-type]
    assert all(0.8 * base <= pause <= 1.2 * base for pause, base in zip(pauses, [1, 2, 4])), pauses
