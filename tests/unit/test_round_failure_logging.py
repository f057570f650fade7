"""hivemind's traceback for a round that failed as rounds may fail is dropped (the peer logs
one line itself); other errors, and everything at DEBUG, keep their tracebacks."""

from __future__ import annotations

import logging
import sys

import pytest
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException

from peer.swarm.swarm import quiet_expected_round_failures

NAME = "hivemind.averaging.averager"


def record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:  # noqa: BLE001
        return logging.getLogger(NAME).makeRecord(NAME, logging.ERROR, __file__, 1, str(error), (), sys.exc_info())


@pytest.fixture
def averager_logger():  # type: ignore[no-untyped-def]
    logger = logging.getLogger(NAME)
    level, filters = logger.level, list(logger.filters)
    quiet_expected_round_failures()
    quiet_expected_round_failures()  # idempotent
    yield logger
    logger.setLevel(level)
    logger.filters[:] = filters


def test_expected_failures_are_dropped_unless_debugging(averager_logger: logging.Logger) -> None:
    assert len([f for f in averager_logger.filters if type(f).__name__ == "_ExpectedRoundFailures"]) == 1
    averager_logger.setLevel(logging.INFO)
    assert not averager_logger.filter(record(AllreduceException("Averaging step failed: could not find a group")))
    assert not averager_logger.filter(record(MatchmakingException("leader disconnected")))
    averager_logger.setLevel(logging.DEBUG)
    assert averager_logger.filter(record(AllreduceException("could not find a group")))


def test_unexpected_errors_and_plain_records_pass(averager_logger: logging.Logger) -> None:
    averager_logger.setLevel(logging.INFO)
    assert averager_logger.filter(record(RuntimeError("a bug")))
    plain = averager_logger.makeRecord(NAME, logging.WARNING, __file__, 1, "retrying", (), None)
    assert averager_logger.filter(plain)
