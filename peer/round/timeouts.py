"""Averaging deadlines that follow what the swarm measurably takes, within bounds.

The spec's ``matchmaking_timeout_s`` and ``allreduce_timeout_s`` are the starting values.
After each successful round the peer records how long it waited for a group (launch to
all-reduce start, which includes waiting for slower peers to finish their inner phase)
and how long the all-reduce itself took; deadlines become ``factor`` times the moving
average plus a small margin, clamped to [spec / 4, spec × 4] (never below 2 s). The
matchmaking deadline never drops below the spec's: it must cover how far apart peers finish
their inner phases, which changes from round to round (a peer that arrived last, and so
waited for nobody, may arrive first next time), and a group that fills early starts at once
whatever the deadline, so a long one costs nothing in a healthy swarm. A failed round
widens both by half, so a deadline that proved too tight recovers quickly.

``matchmaking_windows`` derives the two fixed windows hivemind's matchmaking takes when the
averager starts (how long a peer waits for others to ask it, how long it waits for a leader).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TIMEOUT_S = 2.0


@dataclass
class AdaptiveTimeouts:
    base_matchmaking_s: float
    base_allreduce_s: float
    factor: float = 3.0
    """Deadline = factor × moving average (+ margin)."""
    alpha: float = 0.3
    """Weight of the newest measurement in the moving average."""
    margin_s: float = 1.0

    def __post_init__(self) -> None:
        self._matchmaking_s = self.base_matchmaking_s
        self._allreduce_s = self.base_allreduce_s
        self._seen_matchmaking: float | None = None
        self._seen_allreduce: float | None = None

    @property
    def matchmaking_s(self) -> float:
        return self._matchmaking_s

    @property
    def allreduce_s(self) -> float:
        return self._allreduce_s

    def observe(self, *, matchmaking_s: float, allreduce_s: float) -> None:
        """Record a successful round's durations (seconds)."""
        self._seen_matchmaking = _ema(self._seen_matchmaking, max(matchmaking_s, 0.0), self.alpha)
        self._seen_allreduce = _ema(self._seen_allreduce, max(allreduce_s, 0.0), self.alpha)
        self._matchmaking_s = self._clamp(
            self.factor * self._seen_matchmaking + self.margin_s, self.base_matchmaking_s, floor=1.0
        )
        self._allreduce_s = self._clamp(self.factor * self._seen_allreduce + self.margin_s, self.base_allreduce_s)

    def failed(self) -> None:
        """A round failed (no group, timeout): widen both deadlines."""
        self._matchmaking_s = self._clamp(self._matchmaking_s * 1.5, self.base_matchmaking_s, floor=1.0)
        self._allreduce_s = self._clamp(self._allreduce_s * 1.5, self.base_allreduce_s)

    @staticmethod
    def _clamp(value: float, base: float, floor: float = 0.25) -> float:
        return min(max(value, base * floor, MIN_TIMEOUT_S), base * 4)


def _ema(previous: float | None, value: float, alpha: float) -> float:
    return value if previous is None else (1 - alpha) * previous + alpha * value


def matchmaking_windows(matchmaking_timeout_s: float) -> tuple[float, float]:
    """hivemind's ``(min_matchmaking_time, request_timeout)`` for a spec's matchmaking timeout.

    A peer looking for a group waits at least a third of the timeout for others to ask it;
    a leader that does not answer a request within ``request_timeout`` is given up on. hivemind
    wants ``request_timeout < min_matchmaking_time`` (and warns otherwise): two peers that ask
    each other at once each wait for the other's answer until the request times out, which
    must happen while they are still looking. The request timeout is max(1 s, timeout / 10),
    capped at three quarters of the floor, so only timeouts under 4 s get a shorter one.
    """
    if not matchmaking_timeout_s > 0:
        raise ValueError(f"matchmaking timeout must be positive, got {matchmaking_timeout_s!r}")
    min_matchmaking = matchmaking_timeout_s / 3
    request = min(max(1.0, matchmaking_timeout_s / 10), 0.75 * min_matchmaking)
    return min_matchmaking, request


def search_for_window(window_s: float) -> float:
    """The shortest matchmaking timeout whose ``matchmaking_window`` is at least ``window_s``."""
    if not window_s > 0:
        raise ValueError(f"matchmaking window must be positive, got {window_s!r}")
    shortest = max(2 * window_s if window_s < 1.0 else window_s + 1.0, window_s / 0.9)
    return shortest * (1 + 1e-9)


def matchmaking_window(timeout_s: float) -> float:
    """How long a launched round's leader waits for its group (its declared expiration), for
    a round launched with ``timeout_s`` to find one: most of it, so that peers launching a
    phase apart still find the same leader (a complete roster closes the group at once,
    ``engine.matchmaking``), less the time its followers need to hear that it began."""
    if not timeout_s > 0:
        raise ValueError(f"matchmaking timeout must be positive, got {timeout_s!r}")
    return max(0.5 * timeout_s, timeout_s - max(1.0, 0.1 * timeout_s))


def matchmaking_timeout(timeouts: AdaptiveTimeouts, *, overlap: bool, compute_s: float) -> float:
    """How long a launched round may look for its group. With overlap, waiting costs nothing
    until this peer's next inner phase ends (about ``compute_s``, the phase just finished), so it
    waits at least that long: peers of unequal speed launch further and further apart (each
    one's rounds start when its own inner phase ends), and a deadline shorter than that drift
    failed whole rounds for every member at once."""
    if overlap:
        return max(timeouts.matchmaking_s, compute_s)
    return timeouts.matchmaking_s
