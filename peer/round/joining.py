"""How a peer that adopted the swarm's state joins the swarm's next round: when the members
holding that state launch it (``launches_at``), whether it came too late for it (``too_late``,
then ``next_round`` waits for that round's update), and how long its join may search
(``join_timeout``, ``follow_timeout``)."""

from __future__ import annotations

import logging
import time

from peer.round.adoption import Adoption
from peer.round.local import Crew, LocalState
from peer.round.timeouts import matchmaking_timeout, matchmaking_window, search_for_window

logger = logging.getLogger(__name__)

LANDED_CHECK_S = 2.0
"""While a round looks for its group, how often the peer reads the digest records to learn
whether the swarm landed that round without it (``Landing.abandon_if_landed``)."""
JOIN_LEAD_S = 0.5
"""A peer that adopted a state ends its first phase this long, plus twice its recent DHT lookup
time (``Swarm.lookup_s``), before the members holding it end theirs (``Joining.launches_at``), so
that its declaration is stored where their leader looks when they launch: its last inner step
may overrun the phase, the members' landing times are signed to the millisecond but by clocks
that differ a little, and on a home link a store takes about a second (a newcomer that declared
0.5 s ahead on a 250 kbit/s link was not seen)."""
FOLLOW_MARGIN_S = 1.0
"""How much later than the members it joins a joining round declares to close
(``Joining.follow_timeout``): the members' adaptive deadlines differ a little from its own."""


class Joining:
    """The timing of a join, read from the swarm's digest records and this peer's last phase."""

    def __init__(self, crew: Crew, local: LocalState, adoption: Adoption) -> None:
        self.crew, self.local, self.adoption = crew, local, adoption

    def launches_at(self, round_: int) -> float | None:
        """When (monotonic) the members holding the state of ``round_`` end its inner phase and
        launch the round: they landed it when their digest records say (``Swarm.seen_at``), and
        their phase lasts the spec's time budget. None when that is unknown (no time budget, the
        records unseen): then a peer that just adopted the state joins the round at once, with
        nothing to contribute."""
        budget = self.crew.spec.rounds.time_budget_s
        seen = self.crew.swarm.seen_at(round_)
        if not budget or seen is None:
            return None
        return seen + budget

    def too_late(self) -> bool:
        """Whether the members holding this peer's just-adopted state have launched its round
        already: a search launched now would come after their group formed. Not asked of a peer
        in the roster of the state it adopted (its group made the state without it,
        ``RosterBook.adopted``): that round's leader waits for it by name, so it joins at once
        (a member whose all-reduce failed once cost the round its leader's whole window so)."""
        launch = self.launches_at(self.local.state.round)
        return launch is not None and time.monotonic() >= launch

    def next_round(self) -> None:
        """Wait (up to two phases and a matchmaking timeout) for the swarm to land the round this
        peer came too late for, and roll its state forward by that round's update: it then joins
        the next round from its start (``launches_at``) rather than search after a group that
        formed without it (its search would be given up, ``Landing.abandon_if_landed``, and hold
        up the next)."""
        crew, local = self.crew, self.local
        budget = crew.spec.rounds.time_budget_s or 0.0
        deadline = time.monotonic() + 2 * budget + crew.spec.averaging.matchmaking_timeout_s
        logger.info("round %d is under way without this peer: joining the next", local.state.round)
        digest, records_at = local.state.digest(), time.monotonic() + LANDED_CHECK_S
        timeout = crew.spec.averaging.allreduce_timeout_s
        while not crew.options.stop.is_set() and time.monotonic() < deadline:
            # the round's update, asked for as soon as it lands: members keep it once they hold
            # its state (a read of the records takes seconds on a home link, an ask a round trip)
            update = crew.swarm.download_update(local.state.round, digest, timeout=timeout)
            if update is not None:
                rolled = crew.resync.roll_forward(local.state.clone(), None, verified=None, first=update)
                if rolled is not None and rolled.state.round > local.state.round:
                    # ``launch_now`` again
                    self.adoption.adopt(rolled.state, accepted={rolled.state.digest()}, through=rolled.through)
                return
            if time.monotonic() >= records_at:  # members that keep no updates: the records say it landed
                records_at = time.monotonic() + LANDED_CHECK_S
                agreed = crew.swarm.accepted_state(exclude=crew.identity.public_key)
                if agreed is not None and agreed.round > local.state.round:
                    return
            time.sleep(0.25)

    def follow_timeout(self) -> float:
        """A search long enough that a join declared now expires after the members it joins:
        their window (by this peer's own deadline) from their launch (``launches_at``), plus
        ``FOLLOW_MARGIN_S`` for the differences between their adaptive deadlines and its."""
        launch = self.launches_at(self.local.state.round)
        ahead = 0.0 if launch is None else max(0.0, launch - time.monotonic())
        crew = self.crew
        members = matchmaking_window(
            matchmaking_timeout(crew.timeouts, overlap=crew.overlap, compute_s=self.local.phase_s or 0.0)
        )
        return search_for_window(members + ahead + FOLLOW_MARGIN_S)

    def join_timeout(self, *, newcomer: bool = False) -> float:
        """How long a round launched at once (``launch_now``, or an open-run newcomer's) may look
        for its group: the others launch when their phase ends, up to a whole phase later, so
        twice a phase (this peer's last, else the spec's time budget), at least the matchmaking
        deadline. A newcomer meeting a round ahead, with no phase of its own, counts a phase as
        long as the matchmaking deadline: the round it meets may be one whose roster lost a
        member, which lasts its leader's window."""
        matchmaking_s = self.crew.timeouts.matchmaking_s
        unknown = matchmaking_s if newcomer else 0.0
        phase = self.local.phase_s or self.crew.spec.rounds.time_budget_s or unknown
        return max(matchmaking_s, 2 * phase)
