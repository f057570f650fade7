"""What a flood of heartbeat datagrams may cost a heartbeat process (``Front.datagram``).

A datagram's source can be forged, so neither a per-source limit nor a stranger's key (dropped
before any signature check) bounds what someone who knows admitted peers' public keys (status
lists them) can make the process spend: an Ed25519 check per forged beat. Checks that fail count
against a budget (``FAILED_PER_S``, bursts of ``FAILED_BURST``); past it the process sheds for
``SHED_S``: it checks only beats of keys whose last good beat came from the same source within
``PROVEN_S``, at most one per key each ``PER_KEY_S``, and drops the rest unchecked (those peers
beat over gRPC, whose sources cannot be forged). Honest peers keep their datagrams through a
flood; one that forges a live peer's exact source as well is held to one check per key per
``PER_KEY_S``. Used from the reader thread only.
"""

from __future__ import annotations

import logging

from coordinator.ratelimit import SourceLimiter

logger = logging.getLogger(__name__)

__all__ = ["FloodGuard"]

FAILED_PER_S = 200.0
FAILED_BURST = 1000.0
"""Failed signature checks a second, and in a burst, before shedding: honest peers fail none
(a beat sent again is signed afresh)."""
SHED_S = 5.0
PROVEN_S = 15.0
"""A key's last good beat counts this long (three heartbeat intervals)."""
PER_KEY_S = 2.5
"""While shedding, a key's beats are checked at most this often (a peer beats every 5 s)."""


class FloodGuard:
    def __init__(self) -> None:
        self._failures = SourceLimiter(FAILED_PER_S, FAILED_BURST)
        self._shed_until = -float("inf")
        self._proven: dict[str, tuple[str, float]] = {}
        """Admitted key -> (source of its last good beat, when)."""
        self._checked: dict[str, float] = {}
        """While shedding: key -> when a beat of it was last let through to be checked."""

    def shedding(self, now: float) -> bool:
        return now < self._shed_until

    def admits(self, key: str, source: str, now: float) -> bool:
        """Whether to spend a signature check on a beat of ``key`` from ``source`` at ``now``
        (monotonic seconds)."""
        if not self.shedding(now):
            return True
        proven = self._proven.get(key)
        if proven is None or proven[0] != source or now - proven[1] > PROVEN_S:
            return False
        if now - self._checked.get(key, -float("inf")) < PER_KEY_S:
            return False
        self._checked[key] = now
        return True

    def failed(self, now: float) -> None:
        """A signature check failed."""
        if not self._failures.allow("", now) and not self.shedding(now):
            self._shed_until = now + SHED_S
            self._checked.clear()
            logger.warning(
                "heartbeat datagrams failing their checks in a flood: for %.0f s only peers with a recent good "
                "beat from the same address are checked",
                SHED_S,
            )

    def proved(self, key: str, source: str, now: float) -> None:
        """A good beat of ``key`` (an admitted key) from ``source``."""
        self._proven[key] = (source, now)

    def forget(self, key: str) -> None:
        """``key`` is no longer admitted."""
        self._proven.pop(key, None)
        self._checked.pop(key, None)
