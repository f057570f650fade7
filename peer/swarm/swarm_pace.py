"""How fast the swarm lands rounds, as one peer sees its digest records: what an open run's
newcomer aims by (``peer.swarm.swarm.Swarm._meeting_round``).

The DHT keeps one digest record per signer, its latest, so a look at the records shows each
member's current round, not the rounds between two looks. Two clocks measure the pace:

- the landing times the members signed into their records (``DigestRecord.landed``, DHT time):
  per round the median of those a look shows, so the pace between two rounds is exact whatever
  the lookups' lag, and the time since the round shown landed is known;
- else (records without landing times) this peer's first sightings of each round, between
  looks: never from rounds first seen in the same look (that ratio is 0/n and says nothing).

Either way the pace is measured from the *latest* round known a span before the one shown: a
member that died (or stopped) rounds ago keeps its record, of an old round, in the DHT, and the
pace from that round would count the rounds it missed as rounds the swarm landed between two
looks (the bug this replaced: a newcomer measured 0.12 s a round for a swarm at 0.6 and aimed
65 rounds past it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protocol.statesync import DigestRecord

__all__ = ["MAX_ROUNDS_AHEAD", "PACE_HORIZON_S", "LandingTimes", "SwarmPace", "landing_medians"]

PACE_HORIZON_S = 120.0
"""Sightings older than this are forgotten: the pace is the recent one."""
MIN_SPAN_S = 0.5
"""The pace is measured over at least this long (two looks milliseconds apart say nothing)."""
MAX_SIGHTINGS = 256
"""At most this many rounds remembered (anyone may sign records for any round)."""
MAX_ROUNDS_AHEAD = 64
"""The most rounds a newcomer aims past the one after a round it was shown (a forged round far ahead of the
swarm makes the measured pace absurd; it costs that candidate one attempt either way)."""


def landing_medians(records: Iterable[DigestRecord]) -> dict[int, float]:
    """Per round, the median landing time (DHT time) the records of one look state (archives
    and adopters, which state none, say nothing)."""
    times: dict[int, list[float]] = {}
    for record in records:
        if record.landed is not None and not record.archive:
            times.setdefault(record.round, []).append(record.landed)
    return {round_: statistics.median(at) for round_, at in times.items()}


def _pace_from(times: dict[int, float], shown: int) -> float | None:
    """Seconds a round from the latest round timed at least ``MIN_SPAN_S`` before ``shown`` to it."""
    at = times.get(shown)
    if at is None:
        return None
    earlier = [(round_, when) for round_, when in times.items() if round_ < shown and when <= at - MIN_SPAN_S]
    if not earlier:
        return None
    previous, previous_at = max(earlier)
    return (at - previous_at) / (shown - previous)


@dataclass
class SwarmPace:
    """When (monotonic s) this peer first saw a digest record of each round, and when (DHT time)
    the swarm landed it by the first look that stated it."""

    first_seen: dict[int, float] = field(default_factory=dict)
    landed: dict[int, float] = field(default_factory=dict)

    def saw(self, rounds: set[int], now: float, landed: dict[int, float] | None = None) -> None:
        """One look at the records: the rounds they show (and ``landing_medians`` of them)."""
        for round_ in rounds:
            self.first_seen.setdefault(round_, now)
        for round_, at in (landed or {}).items():
            if round_ in self.first_seen:
                self.landed.setdefault(round_, at)
        stale = [r for r, at in self.first_seen.items() if now - at > PACE_HORIZON_S]
        for round_ in stale:
            del self.first_seen[round_]
        if len(self.first_seen) > MAX_SIGHTINGS:  # keep the latest sightings
            for round_, _ in sorted(self.first_seen.items(), key=lambda item: item[1])[:-MAX_SIGHTINGS]:
                del self.first_seen[round_]
        for round_ in [r for r in self.landed if r not in self.first_seen]:
            del self.landed[round_]

    def seconds_per_round(self, shown: int) -> float | None:
        """The pace up to round ``shown``: by the landing times if two rounds have them, else by
        first sightings (None: ``shown`` unseen, or no lower round timed ``MIN_SPAN_S`` before it)."""
        by_landing = _pace_from(self.landed, shown)
        return by_landing if by_landing is not None else _pace_from(self.first_seen, shown)

    def known(self, shown: int) -> bool:
        return self.seconds_per_round(shown) is not None

    def rounds_ahead(self, shown: int, lead_s: float, now: float, dht_now: float | None = None) -> int:
        """How many rounds past ``shown`` the swarm will be ``lead_s`` seconds from ``now``: 1
        (the round after it, which the swarm launches within about a phase), plus the rounds it
        lands from ``shown``'s landing (by its stated time, given ``dht_now``; at the latest its
        first sighting) to then at the measured pace (unknown: none)."""
        pace = self.seconds_per_round(shown)
        if pace is None:
            return 1
        since = now - self.first_seen.get(shown, now)
        landed = self.landed.get(shown)
        if landed is not None and dht_now is not None:
            since = max(since, dht_now - landed)
        return 1 + min(MAX_ROUNDS_AHEAD, math.ceil((since + lead_s) / pace))


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
