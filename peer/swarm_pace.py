"""How fast the swarm lands rounds, as one peer sees its digest records appear: what an open
run's newcomer aims by (``peer.swarm.Swarm._meeting_round``).

The DHT keeps one digest record per signer, its latest, so a look at the records shows each
member's current round, not the rounds between two looks. The pace is therefore measured
between looks: the time between the first sightings of two rounds over the rounds between
them, never from rounds first seen in the same look (that ratio is 0/n and says nothing).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protocol.statesync import DigestRecord

__all__ = ["MAX_ROUNDS_AHEAD", "PACE_HORIZON_S", "LandingTimes", "SwarmPace"]

PACE_HORIZON_S = 120.0
"""Sightings older than this are forgotten: the pace is the recent one."""
MIN_SPAN_S = 0.5
"""The pace is measured over at least this long (two looks milliseconds apart say nothing)."""
MAX_SIGHTINGS = 256
"""At most this many rounds remembered (anyone may sign records for any round)."""
MAX_ROUNDS_AHEAD = 64
"""The most rounds a newcomer aims past the one after a round it was shown (a forged round far ahead of the
swarm makes the measured pace absurd; it costs that candidate one attempt either way)."""


@dataclass
class SwarmPace:
    """When (monotonic s) this peer first saw a digest record of each round."""

    first_seen: dict[int, float] = field(default_factory=dict)

    def saw(self, rounds: set[int], now: float) -> None:
        """One look at the records: the rounds they show."""
        for round_ in rounds:
            self.first_seen.setdefault(round_, now)
        stale = [r for r, at in self.first_seen.items() if now - at > PACE_HORIZON_S]
        for round_ in stale:
            del self.first_seen[round_]
        if len(self.first_seen) > MAX_SIGHTINGS:  # keep the latest sightings
            for round_, _ in sorted(self.first_seen.items(), key=lambda item: item[1])[:-MAX_SIGHTINGS]:
                del self.first_seen[round_]

    def seconds_per_round(self, shown: int) -> float | None:
        """The pace up to round ``shown``: from the earliest-seen lower round to ``shown``'s first
        sighting (None: ``shown`` unseen, or no lower round seen ``MIN_SPAN_S`` before it)."""
        seen_at = self.first_seen.get(shown)
        if seen_at is None:
            return None
        earlier = [(at, r) for r, at in self.first_seen.items() if r < shown and at <= seen_at - MIN_SPAN_S]
        if not earlier:
            return None
        first_at, first = min(earlier)
        return (seen_at - first_at) / (shown - first)

    def known(self, shown: int) -> bool:
        return self.seconds_per_round(shown) is not None

    def rounds_ahead(self, shown: int, lead_s: float, now: float) -> int:
        """How many rounds past ``shown`` the swarm will be ``lead_s`` seconds from ``now``: 1
        (the round after it, which the swarm launches within about a phase), plus the rounds it
        lands from ``shown``'s first sighting to then at the measured pace (unknown: none)."""
        pace = self.seconds_per_round(shown)
        if pace is None:
            return 1
        elapsed = now - self.first_seen[shown] + lead_s
        return 1 + min(MAX_ROUNDS_AHEAD, math.ceil(elapsed / pace))


@dataclass
class LandingTimes:
    """When the swarm landed each recent round, by the landing times its members signed into
    their digest records (``DigestRecord.landed``): per round the median over the signers (one
    member's clock or lie moves it by no more than the members' spread). A timing hint for a
    peer that adopted a state (when will its holders launch the next round?), never a vote."""

    rounds: dict[int, dict[str, float]] = field(default_factory=dict)

    def saw(self, records: Iterable[DigestRecord], eligible: Callable[[str], bool]) -> None:
        """One look at the records; only ``eligible`` signers' times count (those whose votes
        count, ``protocol.agreement``): keys are free to mint, and a stranger's records for a
        round would otherwise be its median, or push the real rounds out."""
        for record in records:
            if record.landed is not None and not record.archive and eligible(record.signer.id):
                self.rounds.setdefault(record.round, {})[record.signer.id] = record.landed
        for old in sorted(self.rounds)[:-MAX_SIGHTINGS]:
            del self.rounds[old]

    def at(self, round_: int) -> float | None:
        """The median landing time (DHT time) of ``round_`` its signers stated; None if none did."""
        times = self.rounds.get(round_)
        return statistics.median(times.values()) if times else None
