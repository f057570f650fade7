"""A round averaged fragment by fragment while the next inner phase trains (``averaging.
sync_fragments`` = S > 1, with overlap; docs/design/round.md, "Fragments in turn").

The vector is cut into S fragments (``engine.fragments.fragment_bounds``, as the averager cuts
it). Fragment 0 is written when the round launches, at the end of its inner phase; fragment
s > 0 once s/S of the next phase is done and fragment s − 1 has landed. Writing fragment s
keeps θ_local's range as its launch point (one fragment long, the only one alive) and writes
Δ_s = θ_g − launch point (+ the codec residual) into the averager's buffer (one fragment long);
then its gate opens (``PendingAverage.open_fragment``). As soon as the group's average of it is
in, it lands on its range alone: the codec residual, the outer step on θ_g and the momentum, and
θ_local's range re-based by θ_g_new − launch point (``host_passes.land_global`` on views of the
range, then the add), so no range of the model trains more than a fraction of a phase on a
state the group has moved past. The outer step is element-wise, so landing the fragments one by
one gives exactly the bits landing them together would.

The round is judged on fragment 0's answer, which names the group (``peer.round.verdict``); a
peer that does not land it still writes every fragment (its group needs its parts and its
reducer's share). Ranges a fragment's reducers did not average (``FragmentDone.missing``) land
like a failed round's (θ_g and the residual keep their values, θ_local its progress), the same
in every member that lost them. The state's round advances, and its digest is taken, once the
last fragment has landed (``Landing.apply``); until then the state is between two rounds and
is served to nobody.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.fragments import fragment_bounds
from engine.outcome import AllReduceStats, FragmentDone
from peer.round import joining
from peer.round.host_passes import land_global, write_delta_from
from peer.round.inner import InnerPhase
from peer.round.launch import InFlight
from peer.round.local import Crew, LocalState
from peer.round.resync import outer_at
from peer.round.state import GlobalState, model_window, parameter_views, read_model_window
from peer.round.swarm_port import FragmentAnswer, RoundResult
from peer.round.turn import InTurn
from protocol.spec import RunSpec

__all__ = ["FragmentsInTurn", "in_turn_bounds"]

logger = logging.getLogger(__name__)


def in_turn_bounds(spec: RunSpec, numel: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the fragments a vector of ``numel`` values is averaged in, in turn:
    the spec's, whether or not this peer overlaps (``--no-overlap``: every member of a group must
    cut its vector alike, as the averager does; without overlap the fragments go one after
    another at the phase's end), and one where the vector is too short for more
    (``engine.fragments.MIN_FRAGMENT_VALUES`` each)."""
    return fragment_bounds(numel, spec.averaging.fragments_in_turn)


class FragmentsInTurn:
    """Writes, opens and lands a round's fragments in turn (a part of the round, beside
    ``Launcher`` and ``Landing``, which it calls to judge and to give up a search)."""

    def __init__(self, crew: Crew, local: LocalState, landing: object) -> None:
        self.crew, self.local = crew, local
        self.landing = landing
        """``peer.round.landing.Landing`` (typed loosely: it imports ``InFlight`` as this module does)."""
        self._views: list[tuple[int, torch.Tensor]] | None = None

    @property
    def fragments(self) -> int:
        """Fragments in turn (1: the whole vector at once, as without them; ``in_turn_bounds``)."""
        return len(self.bounds())

    def bounds(self) -> list[tuple[int, int]]:
        return in_turn_bounds(self.crew.spec, self.local.state.params.numel())

    def begin(self, *, zeros: bool) -> InTurn:
        """A launched round's fragments: fragment 0 written into the buffer (its gate opens once
        the round has started: ``opened``)."""
        bounds = self.bounds()
        longest = max(end - start for start, end in bounds)
        turn = InTurn(bounds, torch.empty(longest, dtype=torch.float32), zeros)
        self._write(turn, 0)
        return turn

    def opened(self, flight: InFlight) -> None:
        """The round has started: fragment 0's gate opens."""
        turn = flight.turn
        assert turn is not None and turn.next == 0
        turn.answer = flight.pending.open_fragment(0)
        turn.next = 1

    def advance(self, flight: InFlight, inner: InnerPhase | None, *, wait: bool) -> None:
        """Land the fragments answered and write (and open) those due: fragment s once s/S of
        ``inner`` is done. With ``wait``, every fragment now, waiting for each answer."""
        turn = flight.turn
        assert turn is not None
        while not turn.complete():
            if turn.answer is not None:
                if not turn.answer.done():
                    if not wait:
                        return
                    self._await(flight, turn.answer)
                done = turn.answer.result()
                turn.answer = None
                self._take(flight, turn, done)
                continue
            if not wait and inner is not None and inner.share_done() * len(turn.bounds) < turn.next:
                return
            self._write(turn, turn.next)
            turn.answer = flight.pending.open_fragment(turn.next)
            turn.next += 1

    def _await(self, flight: InFlight, answer: FragmentAnswer) -> None:
        """Wait for a fragment's answer (a search still under way is given up if the swarm landed
        the round without this peer: ``Landing.abandon_if_landed``)."""
        since = time.monotonic()
        while True:
            try:
                answer.result(timeout=joining.LANDED_CHECK_S)
                break
            except TimeoutError:
                self.landing.abandon_if_landed(flight)  # type: ignore[attr-defined]
        flight.wait_s += time.monotonic() - since

    def _model_views(self) -> list[tuple[int, torch.Tensor]]:
        if self._views is None:
            self._views = list(parameter_views(self.local.model))
        return self._views

    @torch.no_grad()
    def _write(self, turn: InTurn, index: int) -> None:
        """Fragment ``index``: θ_local's range kept as its launch point, Δ (+ residual) into the
        buffer; zeros where there is nothing to send or Δ is not finite."""
        started = time.monotonic()
        crew, local = self.crew, self.local
        start, end = turn.bounds[index]
        n = end - start
        buffer, launch = crew.swarm.fragment_buffer()[:n], turn.launch[:n]
        read_model_window(self._model_views(), start, launch)
        compensated = not turn.zeros
        if compensated:
            feedback = crew.feedback.window(start, end) if crew.feedback is not None else None
            if not write_delta_from(launch, local.state.params[start:end], buffer, feedback=feedback):
                logger.warning("fragment %d of round %d is not finite: sending zeros", index, local.state.round)
                compensated = False
        if not compensated:
            buffer.zero_()
        turn.compensated.append(compensated and crew.feedback is not None)
        turn.host_s += time.monotonic() - started

    def _take(self, flight: InFlight, turn: InTurn, done: FragmentDone) -> None:
        """A fragment's answer: the round judged on the first, the fragment landed if it lands."""
        turn.allreduce_s += done.allreduce_s
        if done.index == 0:
            self._judge(flight, turn, done)
        if not done.averaged:
            turn.over = done.failed
            if turn.landed:  # a state partly landed is nobody's: re-sync once the round ends
                self.local.in_sync = False
            logger.warning(
                "round %d: fragment %d was not averaged here: %s", self.local.state.round, done.index, done.failed
            )
            return
        if turn.lands:
            self._land(turn, done)

    def _judge(self, flight: InFlight, turn: InTurn, done: FragmentDone) -> None:
        """Whether this peer lands the round, from the group fragment 0's answer names
        (``peer.round.verdict``: the roster rule, a fence without a roster)."""
        crew, local = self.crew, self.local
        if done.members is None:  # no group: the round failed (its work folds into the next)
            turn.lands = False
            return
        members = [data for data in done.members.values() if data is not None]
        result = RoundResult(
            averaged=crew.swarm.fragment_buffer(),
            group_size=len(done.members),
            members=members,
            stats=AllReduceStats(peer_ids=list(done.members)),
            wait_s=0.0,
        )
        gathered = flight.start.gather.round if flight.start is not None else None
        judged = crew.verdict.judge(result, local.state.round, flight.pre_digest, gathered)
        turn.judged = result
        if judged.lands is None:
            flight.failure = judged.failure
            turn.lands = False
            return
        turn.counted = result.started_in_sync(local.state.round, flight.pre_digest)
        turn.lands = turn.counted
        if not turn.counted:  # its group weighed its work 0: it keeps it and re-syncs
            local.in_sync = False
            flight.failure = "it started from another state than its group"
            logger.warning("this peer started round %d from another state than its group", local.state.round)
            return
        logger.info(
            "round %d averages in a group of %d: landing it fragment by fragment", local.state.round, len(members)
        )
        flight.result = result  # (the round as its group shows it, until its last fragment: ``Landing.judge``)
        if crew.journal is not None:
            crew.journal.landing(self.landing.round_metrics(flight, local.state.round + 1), flight.pre_digest)  # type: ignore[attr-defined]
        local.state.wait_for_digest()  # the state changes in place from here on
        local.between_rounds = True

    @torch.no_grad()
    def _land(self, turn: InTurn, done: FragmentDone) -> None:
        """One fragment landed on its range: residual, outer step, θ_local re-based."""
        started = time.monotonic()
        crew, local = self.crew, self.local
        start, end = done.start, done.end
        n = end - start
        state = local.state
        window = GlobalState(state.params[start:end], state.momentum[start:end], state.round)
        index = done.index
        feedback = crew.feedback.window(start, end) if crew.feedback is not None and turn.compensated[index] else None
        shift = turn.launch[:n]
        with local.state_lock:
            land_global(
                window,
                crew.swarm.fragment_buffer()[:n],
                outer_at(crew.spec, state.round),
                feedback=feedback,
                launch_point=shift,
                missing=[(lo - start, hi - start) for lo, hi in done.missing],
                codec=crew.codec.at_round(state.round),
            )
        for values, place in model_window(self._model_views(), start, n):
            values.add_(shift[place].to(values.device))  # θ_local += θ_g_new − launch point
        turn.left_out.extend(done.missing)
        turn.landed += 1
        turn.host_s += time.monotonic() - started
