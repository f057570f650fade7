"""The swarm's pace as an open-run newcomer sees it: when it first saw each round's digest
records, and from that how far ahead of a record the swarm will be a few seconds from now
(``Swarm._meeting_round``: the round a newcomer meets the swarm at)."""

from __future__ import annotations

import math
from collections.abc import Iterable

PACE_ROUNDS = 16
"""The pace is measured over about this many of the newest rounds."""
MAX_ROUNDS_AHEAD = 64


class Sightings:
    """When (monotonic s) this peer first saw a record of each round, kept small: the newest
    ``2 x PACE_ROUNDS`` rounds, and of older ones only the newest round of each lookup (rounds
    first seen together say nothing about the time between them), for the last
    ``PACE_ROUNDS`` lookups. A round at or below what was pruned is never noted again (it
    would count as first seen now)."""

    def __init__(self) -> None:
        self.first_seen: dict[int, float] = {}
        self._floor = -1

    def note(self, rounds: Iterable[int], now: float) -> None:
        """The rounds one lookup of the records returned at ``now``."""
        for round_ in rounds:
            if round_ > self._floor and round_ not in self.first_seen:
                self.first_seen[round_] = now
        if len(self.first_seen) <= 2 * PACE_ROUNDS:
            return
        ordered = sorted(self.first_seen)
        older, newest = ordered[:-PACE_ROUNDS], ordered[-PACE_ROUNDS:]
        self._floor = max(self._floor, older[-1])
        per_lookup: dict[float, int] = {}
        for round_ in older:
            per_lookup[self.first_seen[round_]] = round_  # ascending: the newest of each lookup wins
        kept = sorted(per_lookup.items())[-PACE_ROUNDS:]
        self.first_seen = {r: t for t, r in kept} | {r: self.first_seen[r] for r in newest}

    def rounds_ahead(self, shown: int, *, now: float, lead_s: float) -> int:
        """How far past the round ``shown`` the swarm will be ``lead_s`` seconds from ``now``:
        1, plus the rounds it lands meanwhile at the pace the records of the rounds below
        ``shown`` appeared (unknown: 1). The pace is counted from the newest round of the
        earliest lookup among the last ``PACE_ROUNDS`` rounds (of the latest lookup before
        ``shown``'s when the swarm ran more rounds than that between two lookups), not from
        its oldest round: a newcomer that looks the records up once per attempt would
        otherwise count every round of a lookup as landed since, or find no pace at all."""
        seen_at = self.first_seen.get(shown, now)
        earlier = [(t, r) for r, t in self.first_seen.items() if r < shown and t < seen_at]
        if not earlier:
            return 1
        recent = [t for t, r in earlier if r >= shown - PACE_ROUNDS]
        reference_at = min(recent) if recent else max(t for t, _ in earlier)
        reference = max(r for t, r in earlier if t == reference_at)
        pace = (seen_at - reference_at) / (shown - reference)
        return 1 + min(MAX_ROUNDS_AHEAD, math.ceil((now - seen_at + lead_s) / pace))
