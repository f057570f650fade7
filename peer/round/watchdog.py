"""A peer never sits silent: the watchdog reads each round's metrics and the host's memory, and
says on one line why the peer is not contributing, then leaves cleanly when it cannot.

- **Failed rounds in a row** (``RoundMetrics.averaged`` false; ``failure`` says why): after
  ``WARN_AFTER`` it says so, with the last reason and what usually fixes it, and again every
  ``REMIND_EVERY`` more (the trainer re-syncs by itself after a failed round, and a newcomer
  chasing a fast swarm fails rounds while it catches up: that is no reason to leave). With
  ``leave_after`` (``swarmtrain peer --leave-after-failures N``) it asks the peer to leave
  cleanly after that many, for a supervisor to restart it.
- **Host memory**: when the host has less than ``MIN_AVAILABLE_FRACTION`` of its memory
  available after a round, it leaves cleanly rather than be killed by the kernel mid-round (a
  kill mid all-reduce costs its group that round).

The peer's CLI prints the lines and exits non-zero after a watchdog leave (``reason``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from peer.round.round_metrics import RoundMetrics
from protocol.errors import SwarmtrainError

__all__ = [
    "MIN_AVAILABLE_FRACTION",
    "REMIND_EVERY",
    "WARN_AFTER",
    "Watchdog",
    "WatchdogLeave",
    "available_memory_fraction",
]

logger = logging.getLogger(__name__)

WARN_AFTER = 3
REMIND_EVERY = 10
MIN_AVAILABLE_FRACTION = 0.02


def available_memory_fraction(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """``MemAvailable / MemTotal`` of this host (None where the kernel does not say)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        total = int(fields["MemTotal"].split()[0])
        available = int(fields["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return available / total if total > 0 else None


class WatchdogLeave(SwarmtrainError):
    """The peer left because its watchdog said so (the message says why and what to do)."""


class Watchdog:
    """Reads every round's metrics (``on_round``); ``say`` gets its one-line messages and
    ``leave`` is called once, with the reason, when the peer should stop."""

    def __init__(
        self,
        *,
        say: Callable[[str], None],
        leave: Callable[[str], None],
        warn_after: int = WARN_AFTER,
        leave_after: int = 0,
        memory: Callable[[], float | None] = available_memory_fraction,
        min_available: float = MIN_AVAILABLE_FRACTION,
    ) -> None:
        """``leave_after``: failed rounds in a row after which the peer leaves (0: never)."""
        if warn_after < 1 or leave_after < 0:
            raise ValueError(f"need warn_after >= 1 and leave_after >= 0, got {warn_after} and {leave_after}")
        self.say, self.leave = say, leave
        self.warn_after, self.leave_after = warn_after, leave_after
        self.memory, self.min_available = memory, min_available
        self.failed = 0
        self.reason = ""
        """Why the watchdog asked the peer to leave ("" while it has not)."""

    def on_round(self, metrics: RoundMetrics) -> None:
        if self.reason:
            return
        available = self.memory()
        if available is not None and available < self.min_available:
            self._leave(
                f"the host has {100 * available:.1f}% of its memory left after round {metrics.round}; leaving "
                "before the kernel kills this peer mid-round (free memory, or run fewer processes beside it)"
            )
            return
        if metrics.averaged:
            if self.failed >= self.warn_after:
                self.say(f"averaging again after {self.failed} failed rounds")
            self.failed = 0
            return
        self.failed += 1
        why = metrics.failure or "the round failed"
        if self.failed >= self.warn_after and (self.failed - self.warn_after) % REMIND_EVERY == 0:
            self.say(
                f"{self.failed} rounds in a row failed (last: {why}); this peer keeps trying and re-syncs. "
                f"If it goes on: check that other peers run and can reach this one (swarmtrain doctor)"
            )
        if self.leave_after and self.failed >= self.leave_after:
            self._leave(
                f"{self.failed} rounds in a row failed (last: {why}); leaving. Check this peer's network "
                "path and the swarm's status (swarmtrain doctor, swarmtrain status), then start it again"
            )

    def _leave(self, reason: str) -> None:
        self.reason = reason
        logger.warning("watchdog: %s", reason)
        self.leave(reason)
