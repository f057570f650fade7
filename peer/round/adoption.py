"""Adopting the swarm's state (``Adoption.catch_up``, ``Adoption.adopt``): at start, out of
sync, or when the swarm moved on; with it, this peer's uncounted local work carried over (or
dropped when its own group averaged it in), and reports a previous run left unfinished."""

from __future__ import annotations

import logging

import torch

from peer.round.local import Crew, LocalState
from peer.round.state import GlobalState, flatten, load_flat
from protocol.errors import VerificationError

logger = logging.getLogger(__name__)

MAX_CARRIED_ROUNDS = 2
"""A peer that re-syncs carries its uncounted local work over to the adopted state only if that
state is at most this many rounds ahead of the one the work started from (staler work is dropped)."""


class Adoption:
    """Owns ``in_sync``, ``missed_end``, ``uncounted`` and, when it adopts, ``launch_now`` and
    ``carry_over`` of the peer's ``LocalState``."""

    def __init__(self, crew: Crew, local: LocalState) -> None:
        self.crew, self.local = crew, local

    def publish(self, *, landed: float | None = None) -> None:
        """Publish the digest record of this peer's state (``landed``: when it landed the state
        by averaging, wall clock; None when it adopted it)."""
        state = self.local.state
        self.crew.publisher.publish(state.round, state.digest(), landed)

    def wait_for_group(self) -> bool:
        """Wait (up to ``options.wait_for_group_s``) until ``min_group_size`` peers, this one
        included, published a digest for this peer's round. True if they did."""
        return self.crew.resync.wait_for_group(self.local.state.round, self.crew.options.wait_for_group_s)

    def catch_up(self) -> bool:
        """Adopt the swarm's latest state if ours is not it (``Resync.catch_up``). True if we
        hold the swarm's state."""
        local = self.local
        found = self.crew.resync.catch_up(local.state, local.in_sync)
        if found.ended is not None:
            local.missed_end = found.ended
            return False
        if found.adopt is not None:
            self.adopt(found.adopt.state, accepted=set(found.accepted), through=found.adopt.through)
            return True
        if found.held:
            local.in_sync = True
            self.publish()
        return found.held

    @torch.no_grad()
    def adopt(self, state: GlobalState, *, accepted: set[str], through: tuple[tuple[int, str], ...] = ()) -> None:
        """Make ``state`` this peer's; its digest must be in ``accepted`` (agreed by the swarm);
        ``through``: the states a roll forward passed on the way (``Rolled.through``)."""
        crew, local = self.crew, self.local
        if state.digest() not in accepted:  # the averager checked; check again where it is used
            raise VerificationError("downloaded state does not match the swarm's digest")
        round_ = state.round
        crew.roster.adopted(
            crew.swarm.roster_of(state.digest(), exclude=crew.identity.public_key),
            round_=round_,
            me=crew.identity.public_key.id,
        )
        carried: torch.Tensor | None = None
        if crew.roster.known:  # its own group made this state without it: its work is averaged in
            self._drop_averaged_work(round_)
        else:
            carried = self._work_to_carry(round_)
        with local.state_lock:
            local.state = state
        if local.mirror is not None:
            local.mirror.forget_theta()
        load_flat(local.model, state.params if carried is None else torch.add(state.params, carried))
        local.in_sync = True
        if crew.journal is not None:
            # the states a roll forward passed through are the swarm's too (each update's result
            # checked, the last against the records): a report left unfinished for one of them
            # goes with its digest
            self._finish_reports(round_, passed={passed for passed, _ in through})
            for passed, digest in through:
                if passed < round_:
                    crew.journal.holds(passed, digest)
            crew.journal.holds(round_, state.digest())
        local.launch_now, local.carry_over = True, carried
        logger.info(
            "adopted the swarm's state of round %d (%s), digest verified%s",
            round_,
            state.digest()[:19],
            "; this peer's uncounted local work carried over" if carried is not None else "",
        )
        self.publish()

    def _finish_reports(self, held_round: int, *, passed: set[int]) -> None:
        """Reports a previous run of this peer left unfinished (killed while it landed their
        rounds) for rounds before ``held_round`` that it did not pass through: it never held
        their states, so it asks a member for each round's update, which names the state the
        round made (``FetchedUpdate.post``), and finishes the report with that digest. A server
        that lies costs only that report's credit (the coordinator grants a claim only with the
        digest its group's reports name); none kept it: the report goes (``journal.holds``)."""
        crew = self.crew
        assert crew.journal is not None
        timeout = crew.spec.averaging.allreduce_timeout_s
        for round_, pre in crew.journal.unfinished():
            if round_ >= held_round or round_ in passed or not pre:
                continue
            update = crew.swarm.download_update(round_ - 1, pre, timeout=timeout)
            if update is not None and (update.round, update.pre) == (round_ - 1, pre) and update.post:
                logger.info("round %d's update names the state its group made: finishing its report", round_)
                crew.journal.holds(round_, update.post)

    def _drop_averaged_work(self, adopted_round: int) -> None:
        """The state adopted is the one this peer's own group made while a reducer failed it
        (``RosterBook.missed``): the group averaged this peer's parts in (its reporters name it,
        and the coordinator credits it for that round in absentia), so carrying the same work
        onto that state would weigh and claim it twice. Dropped; what the failed reducer's range
        lacked of it is lost, a sliver of one round."""
        self.local.uncounted = None
        if self.local.unlanded != (0, 0.0):
            logger.info(
                "round %d's state holds this peer's work (its group averaged it in): not carrying it again",
                adopted_round - 1,
            )
        self.local.unlanded = (0, 0.0)

    def _work_to_carry(self, adopted_round: int) -> torch.Tensor | None:
        """The local work the swarm has not counted yet (progress since this peer's start point,
        plus a round its group weighed 0), to re-base onto an adopted state so that it enters
        the next round's pseudo-gradient instead of being thrown away, like the work of a failed
        round. Dropped when it is more than ``MAX_CARRIED_ROUNDS`` rounds stale or not finite."""
        local = self.local
        work = torch.sub(flatten(local.model), local.state.params)
        if local.uncounted is not None:
            work.add_(local.uncounted)
            local.uncounted = None
        if not bool(work.any()):
            local.unlanded = (0, 0.0)
            return None
        if adopted_round - local.state.round > MAX_CARRIED_ROUNDS or not bool(torch.isfinite(work).all()):
            logger.info(
                "dropping this peer's local work: %d rounds stale or not finite", adopted_round - local.state.round
            )
            local.unlanded = (0, 0.0)
            return None
        return work
