"""Whether a round's result is the round's one state here (``protocol.roster``): the part of the
landing that decides, apart from the part that applies. It reads the gathered members, the
roster book and the swarm's records, keeps the roster book current, and says why a round does
not land."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from peer.round.roster_book import RosterBook
from peer.round.swarm_port import RoundResult, SwarmPort
from protocol.roster import Verdict, verdict
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Judged:
    """A round's result as judged here: ``lands`` (the result) or why not (``failure``)."""

    lands: RoundResult | None
    failure: str = ""


class RoundVerdict:
    """Judges each round's result for one peer (``judge``); ``roster``: the peer's roster book,
    which every round that does not land here moves toward releasing its claim."""

    def __init__(self, spec: RunSpec, swarm: SwarmPort, roster: RosterBook) -> None:
        self.spec, self.swarm, self.roster = spec, swarm, roster

    def judge(self, result: RoundResult | None, round_: int, pre_digest: str, gathered_round: int | None) -> Judged:
        """``result`` if it is the round's one state, else why not (the round failed here: its
        work folds into the next). Not when a reducer failed this peer (another member may hold
        that reducer's range: landing without it could make a second state), nor when the
        group holds too few of the roster of its state (``protocol.roster``: another group may
        be the round's). Every round that does not land here counts toward releasing the
        roster claim (``RosterBook.refused``): matchmaking never starts a group the roster rule
        would refuse, so a swarm that lost its roster's majority sees failed rounds, not refusals.
        ``round_``: this peer's state's round; ``gathered_round``: the round it stated."""
        if result is None:
            failure = "no group formed"
            self.roster.refused(Verdict(False, 0, self.roster.size, failure), pre_digest)
            return Judged(None, failure)
        found = verdict(result.members, min_group_size=self.spec.averaging.min_group_size)
        if result.stats.missing:
            failure = f"{100 * result.unaveraged():.0f}% of the vector did not arrive (a reducer failed)"
            logger.warning(
                "round %d: %.1f%% of the vector did not arrive (a reducer, or this peer's all-reduce, failed); "
                "not landing it",
                round_,
                100 * result.unaveraged(),
            )
            if found.lands:  # the others land it: the state they make has this peer in its roster
                assert gathered_round is not None
                self.roster.missed(gathered_round, result.members, pre_digest)
                self.swarm.saw_group(result.members)  # its members vote: it takes part in their state
            else:
                self.roster.refused(found, pre_digest)
            return Judged(None, failure)
        if not found.lands:
            failure = f"its group was not the round's ({found.reason})"
            logger.warning("round %d: this group is not the round's (%s); not landing it", round_, found.reason)
            self.roster.refused(found, pre_digest)
            return Judged(None, failure)
        if found.roster == 0 and (beside := self.landed_beside(result, round_)):
            failure = f"{len(beside)} peers outside its group landed this round first (no roster claimed)"
            logger.warning(
                "round %d: %d peers outside this group landed it first and this group claims no roster; not landing it",
                round_,
                len(beside),
            )
            self.roster.refused(Verdict(False, found.holders, 0, failure), pre_digest)
            return Judged(None, failure)
        return Judged(result)

    def landed_beside(self, result: RoundResult, round_: int) -> frozenset[str]:
        """The fence of a group that claims no roster (``protocol.roster``): who outside it
        landed ``round_`` already, within a round's longest time (a dead peer's record of a
        timeline the swarm rolled back from is older)."""
        group = frozenset(member.id for member in result.members if member.id)
        averaging = self.spec.averaging
        within_s = 2 * (averaging.matchmaking_timeout_s + averaging.allreduce_timeout_s)
        return self.swarm.landed_beside(round_, group, within_s=within_s)
