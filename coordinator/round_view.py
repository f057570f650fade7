"""Per-round figures of how the swarm averaged: groups, distinct states, peers that averaged.

The design goal is one group and one state a round; these figures are how an operator sees a
round that split. They come from the round reports (``Coordinator.report_round``): a peer
reports a round only when its averaging succeeded (``peer.link.coordinator_client.CoordinatorLink
.report``; a failed round only counts in its heartbeats' ``rounds_failed``), naming the round
of the state it landed, every member of its group (itself included) and that state's digest.
For round r:

- **groups**: distinct member sets named by the round's reports that name at least two peers
  (a report naming its reporter alone, which older peers sent, is a peer that averaged with
  nobody, not a group). Members of one hivemind group all gather the same members, so a
  healthy round has 1; a round split by matchmaking has more.
- **states**: distinct non-empty ``state_digest`` of those same reports (peers that averaged).
- **peers_averaged**: distinct keys named in those groups, reporters included: a member
  whose report has not come (or never will) still averaged with the others.
- **reports**: every report of the round, groups of one included.

Work is O(group) a report (one pass over the members); memory is bounded: only the
``window`` highest rounds are kept (a report of a lower round is dropped once the window is
full), each with at most ``MAX_KEYS`` member keys and digests (a report naming more saturates
the figure instead of growing it; ``coordinator.limits.MAX_GROUP`` keys is the most an honest
group names) and one hash per distinct group (``hash(frozenset)``: members in any order are
one group). After a restart the window is rebuilt from the store's newest claims
(``Store.recent_claims``); a malformed stored row is skipped, never raised.

Reports are signed by admitted peers, but in an open run keys are free: a peer can name keys
that never averaged (raising ``peers_averaged``), and reports of rounds far above the swarm's
push its real rounds out of the window. The view is what the reports say, for an operator to
read; it grants and denies nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.limits import MAX_GROUP
from coordinator.store.rows import ClaimRow

logger = logging.getLogger(__name__)

ROUND_WINDOW = 20
"""Rounds kept (the highest ones reported): what status, the dashboard and ``/metrics`` show."""
MAX_KEYS = MAX_GROUP
"""Member keys and digests kept per round; a figure stops growing there."""


@dataclass(frozen=True)
class RoundFigures:
    """What one round's reports say about how it averaged (see the module's docstring)."""

    round: int
    groups: int
    states: int
    peers_averaged: int
    reports: int
    decided: bool
    """The coordinator decided claims of this round (``Coordinator.tick``): its reports are in
    (every member reported, or the round's first claim is 60 s old); later ones still count."""


@dataclass
class _Round:
    groups: set[int] = field(default_factory=set)
    states: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)
    reports: int = 0
    decided: bool = False

    def figures(self, round_: int) -> RoundFigures:
        return RoundFigures(
            round=round_,
            groups=len(self.groups),
            states=len(self.states),
            peers_averaged=len(self.members),
            reports=self.reports,
            decided=self.decided,
        )


class RoundWindow:
    """The figures of the ``window`` highest rounds reported, updated report by report."""

    def __init__(self, window: int = ROUND_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"a round window holds at least one round, not {window}")
        self.window = window
        self._rounds: dict[int, _Round] = {}

    def add(self, *, round: int, reporter: str, members: Iterable[str], state_digest: str) -> None:
        """Count one report of ``round`` by ``reporter`` naming ``members`` (its group)."""
        entry = self._entry(round)
        if entry is None:
            return
        entry.reports += 1
        group = frozenset(members) | {reporter}
        if len(group) < 2:  # averaged with nobody: not a group, no state landed by averaging
            return
        if len(entry.groups) < MAX_KEYS:
            entry.groups.add(hash(group))
        if state_digest and len(entry.states) < MAX_KEYS:
            entry.states.add(state_digest)
        for key in group:
            if len(entry.members) >= MAX_KEYS:
                break
            entry.members.add(key)

    def add_row(self, row: ClaimRow | Mapping[str, Any]) -> bool:
        """Count one stored claim (``Store.recent_claims``: key, round, group_json, state_digest,
        status); False, and nothing counted, if the row is malformed (what a database holds is
        checked like anything read back: a row written by another version, or by hand)."""
        if isinstance(row, ClaimRow):
            row = dataclasses.asdict(row)
        try:
            round_, reporter, digest = row["round"], row["key"], row["state_digest"]
            entries = json.loads(row["group_json"])
        except (KeyError, TypeError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
            return False
        if not (isinstance(round_, int) and isinstance(reporter, str) and isinstance(entries, list)):
            return False
        members = [e[0] for e in entries if isinstance(e, list) and e and isinstance(e[0], str) and e[0]]
        self.add(
            round=round_, reporter=reporter, members=members, state_digest=digest if isinstance(digest, str) else ""
        )
        if row.get("status", "pending") != "pending":
            self.decided(round_)
        return True

    def load(self, rows: Iterable[ClaimRow | Mapping[str, Any]]) -> None:
        """Count stored claims (after a restart); malformed rows are skipped and counted in one line."""
        skipped = sum(0 if self.add_row(row) else 1 for row in rows)
        if skipped:
            logger.warning("round view: skipped %d malformed stored round report(s)", skipped)

    def decided(self, round_: int) -> None:
        """The coordinator decided claims of ``round_`` (a round outside the window is ignored)."""
        entry = self._rounds.get(round_)
        if entry is not None:
            entry.decided = True

    def figures(self) -> list[RoundFigures]:
        """Every round in the window, highest first."""
        return [self._rounds[r].figures(r) for r in sorted(self._rounds, reverse=True)]

    def latest_decided(self) -> RoundFigures | None:
        """The highest decided round in the window, if any."""
        decided = [r for r, entry in self._rounds.items() if entry.decided]
        return self._rounds[max(decided)].figures(max(decided)) if decided else None

    def split_rounds(self) -> int:
        """Rounds in the window whose averaged peers landed more than one state."""
        return sum(1 for entry in self._rounds.values() if len(entry.states) > 1)

    def _entry(self, round_: int) -> _Round | None:
        entry = self._rounds.get(round_)
        if entry is not None:
            return entry
        if len(self._rounds) >= self.window:
            lowest = min(self._rounds)
            if round_ < lowest:
                return None
            del self._rounds[lowest]
        entry = self._rounds[round_] = _Round()
        return entry
