"""What this peer knows of the roster of the state it holds (``protocol.roster``), and what it
gathers to its group about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from protocol.roster import ROSTER_RELEASE_AFTER, Verdict, in_sync_count

logger = logging.getLogger(__name__)


@dataclass
class RosterBook:
    """The roster of this peer's current state.

    - ``size``: its roster size (0: unknown: the initial state, or released);
    - ``known``: this peer is in that roster (it landed the state by averaging);
    - ``failures``: rounds in a row its group failed the roster rule at this state.
    """

    size: int = 0
    known: bool = False
    failures: int = 0
    _state: str = ""

    def gather(self) -> dict[str, Any]:
        """The fields this peer adds to its round's gathered metadata."""
        return {"roster": self.size, "known": self.known}

    def landed(self, members: list[Any]) -> None:
        """This peer landed a round of a group that gathered ``members``, from its agreed state."""
        self.size, self.known, self.failures, self._state = in_sync_count(members), True, 0, ""

    def adopted(self, size: int) -> None:
        """This peer took a state by download; its holders published ``size`` as its roster."""
        self.size, self.known, self.failures, self._state = size, False, 0, ""

    def refused(self, verdict: Verdict, digest: str) -> None:
        """This peer's round did not land at the state ``digest`` (its group failed the roster
        rule, no group formed, or a reducer failed it): after ``ROSTER_RELEASE_AFTER`` such
        rounds in a row, stop claiming the roster."""
        self.failures = self.failures + 1 if self._state == digest else 1
        self._state = digest
        if self.size and self.failures >= ROSTER_RELEASE_AFTER:
            logger.warning(
                "%d rounds in a row found too few of this state's roster of %d (%s): no longer claiming it",
                self.failures,
                self.size,
                verdict.reason,
            )
            self.size, self.known = 0, False
