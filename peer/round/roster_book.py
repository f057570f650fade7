"""What this peer knows of the roster of the state it holds (``protocol.roster``), and what it
gathers to its group about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.gathered import Gathered
from protocol.roster import ROSTER_RELEASE_AFTER, RosterClaim, Verdict, in_sync_count, in_sync_ids

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Missed:
    """A round this peer started in sync, in a group whose round lands, but could not land
    itself (a reducer failed it): the state of ``round`` its group made has ``ids`` as roster."""

    round: int
    ids: frozenset[str]

    @property
    def size(self) -> int:
        return len(self.ids)


@dataclass
class RosterBook:
    """The roster of this peer's current state.

    - ``size``: its roster size (0: unknown: the initial state, or released);
    - ``known``: this peer is in that roster (it landed the state by averaging, or its group
      landed it without it: ``missed``); a release keeps it (``refused``);
    - ``failures``: rounds in a row its group failed the roster rule at this state.
    """

    size: int = 0
    known: bool = False
    failures: int = 0
    _state: str = ""
    _missed: _Missed | None = None

    def landed(self, members: list[Gathered]) -> None:
        """This peer landed a round of a group that gathered ``members``, from its agreed state."""
        self.size, self.known, self.failures, self._state, self._missed = in_sync_count(members), True, 0, "", None

    def missed(self, round_: int, members: list[Gathered], digest: str) -> None:
        """This peer started round ``round_`` from the state ``digest`` in a group that gathered
        ``members`` and passes the roster rule, but a reducer failed it: the other members land
        the round without it. It counts as a failed round (``refused``), and if this peer was
        in sync (named among the group's in-sync ids), the state its group makes has it in its
        roster (``adopted``)."""
        self.refused(Verdict(False, 0, self.size, "a reducer failed"), digest)
        ids = in_sync_ids(members)
        self._missed = _Missed(round_ + 1, ids) if ids else None

    def adopted(self, claim: RosterClaim, *, round_: int, me: str) -> None:
        """This peer took the state of round ``round_`` by download; its eligible holders
        published ``claim``. The peer is known in its roster only if that state is the one its
        own group made without it (``missed``): the claimed roster is that group's, this peer
        is in it, and more than half of it, by name, hold the state (an honest majority of the
        group lands one state: the group's)."""
        missed = self._missed
        known = (
            missed is not None
            and missed.round == round_
            and me in missed.ids
            and claim.size == missed.size
            and 2 * len(claim.holders & missed.ids) > missed.size
        )
        self.size, self.known, self.failures, self._state, self._missed = claim.size, known, 0, "", None
        if known:
            logger.info("the adopted state is the one this peer's group made without it: in its roster again")

    def refused(self, verdict: Verdict, digest: str) -> None:
        """This peer's round did not land at the state ``digest`` (its group failed the roster
        rule, no group formed, or a reducer failed it): after ``ROSTER_RELEASE_AFTER`` such
        rounds in a row, stop claiming the roster's size. It stays ``known``: it is still one of
        the members that made the state, so it counts toward the majority a holder that still
        claims the size asks for. A newcomer that adopted the state before the release claims
        the size and is not known; released members that counted for nothing beside it failed
        every group they formed with it until it released too (two NAT'ed peers whose relays
        both died, with a new volunteer: a minute without a round)."""
        self._missed = None
        self.failures = self.failures + 1 if self._state == digest else 1
        self._state = digest
        if self.size and self.failures >= ROSTER_RELEASE_AFTER:
            logger.warning(
                "%d rounds in a row found too few of this state's roster of %d (%s): no longer claiming it",
                self.failures,
                self.size,
                verdict.reason,
            )
            self.size = 0
