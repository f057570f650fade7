from __future__ import annotations

import pytest

from swarmtrain.localswarm import wait_until


def test_transient_failures_count_as_not_yet() -> None:
    calls = []

    def predicate() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("not listening yet")
        if len(calls) == 2:
            raise AssertionError("not ready")
        return True

    wait_until(predicate, 5, "the service")
    assert len(calls) == 3


def test_the_deadline_names_what_and_the_last_error() -> None:
    def predicate() -> bool:
        raise ConnectionRefusedError("not listening")

    with pytest.raises(TimeoutError, match=r"the service \(last error: ConnectionRefusedError"):
        wait_until(predicate, 0.3, "the service")


def test_a_programming_error_is_not_swallowed() -> None:
    def predicate() -> bool:
        raise KeyError("typo")

    with pytest.raises(KeyError):
        wait_until(predicate, 5, "the service")
