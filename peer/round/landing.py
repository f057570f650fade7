"""Landing a round (``Landing.land``, the only place a round lands): its result judged
(``peer.round.verdict``), then the outer step on the group's average (Nesterov SGD, identical
bytes in every member), θ_local re-based onto the new θ_g with the progress made since the
launch, and the codec residual of what was sent; or, for a failed round, nothing of the state
changes and its work folds into the next. With overlap the host half runs on the landing thread
while the inner steps go on, and only the re-base runs between two inner steps. A landed round
is recorded (``record_landed``: digest record, kept update, checkpoint, metrics row) once the new
state's digest, hashed in the background, is known."""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.compression import ErrorFeedback
from peer.round import joining
from peer.round.adoption import Adoption
from peer.round.host_passes import land_global, land_round, model_is_finite, rebase_model, undo_eager_start
from peer.round.inner import InnerSteps
from peer.round.launch import InFlight
from peer.round.local import Crew, LocalState
from peer.round.resync import outer_at
from peer.round.round_metrics import RoundMetrics
from peer.round.saving import save
from peer.round.state import flatten, load_flat
from peer.round.swarm_port import RoundResult
from peer.round.validation import validates, validation_loss
from protocol.spec import OuterSection

logger = logging.getLogger(__name__)


class Landed(enum.Enum):
    """Where ``Landing.land`` left a round."""

    RUNNING = "running"
    """Its host half runs on the landing thread: land it again once due (the inner steps go on)."""
    DONE = "done"
    """Landed (or failed) and recorded, or recorded once the new state's digest is known."""
    OUT_OF_SYNC = "out of sync"
    """Landed or failed, and this peer no longer holds the swarm's state: the loop re-syncs, then
    records the round (``Landing.record``)."""


@dataclass
class _Recorded:
    """A round that landed, recorded once the new state's digest is known."""

    metrics: RoundMetrics
    checkpoint: bool
    host_s: float
    """Host time so far (launch preparation and landing)."""
    kept: tuple[int, str, list[tuple[int, int]]] | None = None
    """A round that landed in sync: (its round, the digest it started from, left-out ranges),
    for the swarm to keep its update once the new digest is known."""
    at: float | None = None
    """When (wall clock) it landed in sync, the next round's inner phase beginning: signed into
    the state's digest record (``DigestRecord.landed``)."""


class Landing:
    """Lands rounds; owns ``state`` (changed in place under ``state_lock``), the codec residual,
    the adaptive timeouts, ``history`` and checkpoints, and ``unlanded`` for rounds that fail."""

    def __init__(self, crew: Crew, local: LocalState, inner: InnerSteps, adoption: Adoption) -> None:
        self.crew, self.local, self.inner, self.adoption = crew, local, inner, adoption
        self.unrecorded: _Recorded | None = None
        """The last landed round, until its digest is known and it is recorded."""
        self._landed_check_at = 0.0
        """When ``abandon_if_landed`` may read the records again."""

    def waits(self, flight: InFlight) -> bool:
        """Whether landing ``flight`` must wait for its result first (``await_result``)."""
        return flight.landing is None and not flight.pending.done()

    def await_result(self, flight: InFlight, *, since: float) -> None:
        """Wait for the round's result, giving it up if the swarm landed it without this peer
        (``since``: when the loop began to wait, monotonic)."""
        while not flight.pending.wait(joining.LANDED_CHECK_S):
            self.abandon_if_landed(flight)
        flight.wait_s += time.monotonic() - since

    def judge(self, flight: InFlight) -> None:
        """Judge the round's result, once it is in (``peer.round.verdict``), and tell the journal
        that a round that averaged begins to land."""
        local = self.local
        started = time.monotonic()
        if flight.turn is not None:  # judged on its first fragment's answer (``peer.round.in_turn``)
            final = flight.pending.result()
            result = flight.result = final if flight.turn.landed else None
            if result is None and not flight.failure:
                flight.failure = flight.turn.failure() if flight.turn.judged is not None else "no group formed"
            flight.judged_at = time.monotonic()
            flight.wait_s += flight.judged_at - started
            return
        result = flight.result = self._the_rounds_state(flight.pending.result(), flight)
        flight.judged_at = time.monotonic()
        flight.wait_s += flight.judged_at - started
        if result is not None:
            logger.info("round %d averaged in a group of %d: landing it", local.state.round, result.group_size)
            if self.crew.journal is not None:
                self.crew.journal.landing(self.round_metrics(flight, local.state.round + 1), flight.pre_digest)

    def land(self, flight: InFlight, *, wait: bool) -> Landed:
        """Land the round in flight, its result judged (``judge``): apply or undo it and record
        it. With overlap a successful round's host half runs on the landing thread: then, unless
        ``wait``, ``RUNNING`` until it is done."""
        if flight.landing is None:
            assert flight.judged_at is not None, "a round is judged before it lands"
            applied = self.apply(flight, flight.result)
            flight.host_s = time.monotonic() - flight.judged_at
            if isinstance(applied, Future):
                flight.landing = applied
                if not wait:
                    return Landed.RUNNING
            else:
                return self._close(flight, digest_known=applied)
        assert flight.landing is not None
        blocked = time.monotonic()
        flight.landing.result()  # its errors are the training thread's
        started = time.monotonic()
        flight.wait_s += started - blocked
        digest_known = self._rebase(flight)
        flight.host_s += time.monotonic() - started
        return self._close(flight, digest_known=digest_known)

    def _close(self, flight: InFlight, *, digest_known: bool) -> Landed:
        if not self.local.in_sync:
            return Landed.OUT_OF_SYNC
        self.record(flight, digest_known=digest_known)
        return Landed.DONE

    def record(self, flight: InFlight, *, digest_known: bool = True) -> None:
        """Record a round that landed (or failed): its metrics, once the new state's digest is
        known (after a re-sync the loop ran, ``Landed.OUT_OF_SYNC``, its host time is counted)."""
        result, state = flight.result, self.local.state
        metrics = self.round_metrics(flight, state.round)
        checkpoint = result is not None and state.round % self.crew.options.checkpoint_every == 0
        left_out = flight.turn.left_out if flight.turn is not None else result.stats.left_out if result else []
        kept = (state.round - 1, flight.pre_digest, list(left_out)) if result and flight.counted else None
        at = time.time() if kept is not None else None
        self.unrecorded = _Recorded(metrics, checkpoint, flight.prep_s + flight.host_s, kept, at)
        if digest_known:
            self.record_landed(wait=True)

    def round_metrics(self, flight: InFlight, round_: int) -> RoundMetrics:
        """The metrics of the round ``flight`` averaged (or failed), numbered ``round_``, without
        the new state's digest."""
        crew, local = self.crew, self.local
        result = flight.result
        landing_s = flight.landing.result() if flight.landing is not None else 0.0
        return RoundMetrics(
            round=round_,
            group_size=result.group_size if result else 1,
            samples=flight.samples,
            carried=flight.carried,
            carried_s=round(flight.carried_s, 4),
            loss=flight.loss,
            state_digest="",  # filled in by record_landed
            bytes_sent=result.stats.bytes_sent if result else 0,
            bytes_received=result.stats.bytes_received if result else 0,
            compute_s=round(flight.compute_s, 4),
            wait_s=round(flight.wait_s, 4),
            wall_s=round(flight.compute_s + (time.monotonic() - flight.launched_at), 4),
            # an averaged round's row says whether it counted (it started from its group's state),
            # not what the peer is by the time the row is written: with the landing on its own
            # thread, a peer whose round did not count may re-sync before its row is recorded,
            # and its row then named its own stale landing "in sync" (the churn lab counted it
            # as a second state and as credit lost, which the coordinator had rightly denied)
            in_sync=flight.counted if result is not None else local.in_sync,
            averaged=result is not None,
            members=result.members if result else [],
            offenders=result.offenders if result else {},
            receipts=result.receipts if result else {},
            unaveraged=round(result.unaveraged(), 6) if result else 0.0,
            left_out=round(result.left_out_share(), 6) if result else 0.0,
            failure=flight.failure,
            audit_s=round(result.stats.audit_s, 4) if result else 0.0,
            audit_bytes=result.stats.audit_bytes if result else 0,
            params=local.state.params.numel(),
            # (fragments in turn: their all-reduces' own seconds, not the round's span across the phase)
            allreduce_s=round(flight.turn.allreduce_s if flight.turn else result.stats.allreduce_s, 4)
            if result
            else 0.0,
            matchmaking_s=round(result.matchmaking_s, 4) if result else 0.0,
            matchmaking_timeout_s=round(crew.timeouts.matchmaking_s, 2),
            allreduce_timeout_s=round(crew.timeouts.allreduce_s, 2),
            local_world_size=crew.ranks.world_size,
            lr=flight.lr,
            data=flight.data,
            launch_s=round(flight.prep_s, 4),
            landing_s=round(landing_s, 4),
        )

    def record_landed(self, *, wait: bool) -> None:
        """Finish the round that landed last once the new state's digest is known (it is hashed
        on a background thread while the next inner steps run): publish the digest record,
        write the checkpoint, record the metrics. Without ``wait``, only if the digest is ready."""
        crew, local = self.crew, self.local
        landed = self.unrecorded
        if landed is None or (not wait and not local.state.digest_ready()):
            return
        started = time.monotonic()
        digest = local.state.digest()
        if crew.publisher.snapshot[:2] != (local.state.round, digest):
            self.adoption.publish(landed=landed.at)
        if landed.kept is not None:
            round_, pre, left_out = landed.kept
            crew.swarm.keep_update(round_, pre, digest, left_out)
        if landed.checkpoint:
            save(crew, local)
        self.unrecorded = None
        val_loss = validation_loss(crew, local) if landed.metrics.averaged else None
        metrics = dataclasses.replace(
            landed.metrics,
            state_digest=digest,
            val_loss=val_loss,
            host_s=round(landed.host_s + time.monotonic() - started, 4),
            record_s=round(time.monotonic() - started, 4),
            digest_s=round(local.state.digest_s, 4),
            at=round(time.time(), 3),
        )
        local.history.append(metrics)
        crew.on_round(metrics)

    def _adapt_timeouts(self, result: RoundResult | None, allreduce_s: float | None = None) -> None:
        """Learn from the round (``allreduce_s``: its all-reduce's own seconds where the
        averager's span more, fragments in turn)."""
        timeouts = self.crew.timeouts
        before = timeouts.allreduce_s
        if result is None:
            timeouts.failed()
        else:
            own = result.stats.allreduce_s if allreduce_s is None else allreduce_s
            timeouts.observe(matchmaking_s=result.round_s - result.stats.allreduce_s, allreduce_s=own)
        if abs(timeouts.allreduce_s - before) > 0.1 * before:
            self.crew.swarm.set_allreduce_timeout(timeouts.allreduce_s)

    @torch.no_grad()
    def apply(self, flight: InFlight, result: RoundResult | None) -> bool | Future[float]:
        """Apply the round's result here (or undo a failed round); True when the new state's
        digest is known (a failed round, or this peer fell out of sync), False while it is
        hashed in the background (``record_landed`` publishes it). With overlap, a successful
        round's host half goes to the landing thread: its future (``_rebase`` ends the landing)."""
        crew, local = self.crew, self.local
        if flight.turn is not None:
            return self._finish_in_turn(flight, result)
        self._adapt_timeouts(result)
        local.uncounted = None
        counted = result is not None and result.started_in_sync(local.state.round, flight.pre_digest)
        flight.counted = counted
        if not counted:  # its work stays in the model (or goes with it onto the state it adopts next)
            samples, seconds = local.unlanded
            local.unlanded = (samples + flight.samples + flight.carried, seconds + flight.compute_s + flight.carried_s)
        if result is None:
            self._undo(flight)
            return True
        if not counted:
            local.in_sync = False
            logger.warning("this peer started round %d from another state than its group", local.state.round)
            # its group weighed this round's work 0: carry it into the state it adopts next
            launched = local.launch_point if local.launch_point is not None else flatten(local.model)
            local.uncounted = torch.sub(launched, local.state.params)
        else:
            crew.roster.landed(result.members)
        crew.swarm.saw_group(result.members)
        keep_progress = crew.overlap and model_is_finite(local.model)
        outer = outer_at(crew.spec, local.state.round)
        feedback = crew.feedback if flight.compensated and counted else None
        if crew.options.host_thread and keep_progress and local.launch_point is not None and not crew.ranks.sharded:
            return crew.lander.submit(
                self._land_global, result.averaged, outer, feedback, flight.eager, result.stats.left_out
            )
        with local.state_lock:
            land_round(
                local.model,
                local.state,
                result.averaged,
                outer,
                feedback=feedback,
                launch_point=local.launch_point,
                keep_progress=keep_progress,
                staging=crew.staging,
                eager=flight.eager,
                codec=crew.codec.at_round(local.state.round),
                missing=result.stats.left_out,
            )
            self._carried_back(flight)
        if crew.overlap and not keep_progress:
            self.inner.drop_local_work(f"its model went non-finite while round {local.state.round - 1} averaged")
        return self._landed_state()

    def _finish_in_turn(self, flight: InFlight, result: RoundResult | None) -> bool:
        """A round whose fragments landed in turn (``peer.round.in_turn``): its state's round
        advances once the last has landed. One that landed no fragment failed (its work folds
        into the next); one that landed some and not all left a state nobody holds: the peer
        re-syncs. As ``apply``'s return."""
        crew, local, turn = self.crew, self.local, flight.turn
        assert turn is not None
        self._adapt_timeouts(flight.pending.result() if result is None else result, turn.allreduce_s)
        local.uncounted = None
        flight.counted = turn.counted and turn.landed == len(turn.bounds)
        if not flight.counted:  # its work stays in the model (or goes with it onto the state it adopts next)
            samples, seconds = local.unlanded
            local.unlanded = (samples + flight.samples + flight.carried, seconds + flight.compute_s + flight.carried_s)
        flight.host_s += turn.host_s
        if result is None:
            self._undo(flight)
            return True
        crew.roster.landed(result.members)
        crew.swarm.saw_group(result.members)
        with local.state_lock:
            local.state.round += 1
            local.between_rounds = False
        if turn.landed < len(turn.bounds):
            local.in_sync = False
            logger.warning(
                "round %d landed %d of its %d fragments here: re-syncing", local.state.round - 1, turn.landed,
                len(turn.bounds),
            )  # fmt: skip
        if not model_is_finite(local.model):
            self.inner.drop_local_work(f"its model went non-finite while round {local.state.round - 1} averaged")
        self._carried_back(flight)
        return self._landed_state()

    def _undo(self, flight: InFlight) -> None:
        """A failed round: θ_g, the momentum and the codec residual are untouched, so its work
        folds into the next round's pseudo-gradient; an eager start is taken back."""
        crew, local = self.crew, self.local
        if flight.eager and model_is_finite(local.model):
            assert local.launch_point is not None
            with local.state_lock:
                outer = outer_at(crew.spec, local.state.round)
                undo_eager_start(local.model, local.state, local.launch_point, outer, crew.staging)
        local.carry_over = None  # still in the model: the next round's Δ holds it
        if self._swarm_moved_on():
            # others averaged without us: training on from the old state would only make this
            # peer a stale member of its next group (weight 0), so re-sync first
            logger.warning("round %d failed here but the swarm moved on; catching up", local.state.round)
            local.in_sync = False

    def _carried_back(self, flight: InFlight) -> None:
        """Work carried onto an adopted state was held out of this round: back in once it counted
        (not counted: ``uncounted`` holds it, from the launch point)."""
        local = self.local
        if local.carry_over is not None and flight.counted:
            load_flat(local.model, torch.add(flatten(local.model), local.carry_over))
        local.carry_over = None

    def _landed_state(self) -> bool:
        """After a successful round's landing: hash the new state in the background (False), or,
        out of sync, publish it (True: the loop re-syncs)."""
        if self.local.in_sync:
            self.local.state.start_digest()
            return False
        self.adoption.publish()
        return True

    def _land_global(
        self,
        averaged: torch.Tensor,
        outer: OuterSection,
        feedback: ErrorFeedback | None,
        eager: bool,
        left_out: list[tuple[int, int]],
    ) -> float:
        """The landing's host half (``peer.round.host_passes.land_global``), on the landing thread:
        the model is not touched, the launch point becomes the re-base shift. Its seconds."""
        crew, local = self.crew, self.local
        started = time.monotonic()
        assert local.launch_point is not None
        with local.state_lock:
            land_global(
                local.state,
                averaged,
                outer,
                feedback=feedback,
                launch_point=local.launch_point,
                eager=eager,
                codec=crew.codec.at_round(local.state.round),
                missing=left_out,
            )
        if local.mirror is not None:  # (never made for an eager start: ``Launcher.launch``)
            local.mirror.upload_shift(local.launch_point)
            if validates(crew, local.state.round + 1):
                local.mirror.stage_theta(local.state.params, local.state.round + 1)
        return time.monotonic() - started

    @torch.no_grad()
    def _rebase(self, flight: InFlight) -> bool:
        """The landing's last part, between two inner steps: θ_local += the shift the landing
        thread left in the launch point; the round advances. As ``apply``'s return."""
        local = self.local
        assert local.launch_point is not None
        if local.mirror is not None:
            local.mirror.rebase(local.model)
        else:
            rebase_model(local.model, local.launch_point)
        with local.state_lock:
            local.state.round += 1
        self._carried_back(flight)
        return self._landed_state()

    def _the_rounds_state(self, result: RoundResult | None, flight: InFlight) -> RoundResult | None:
        """``result`` if it is the round's one state here (``RoundVerdict.judge``), else None with
        the reason in ``flight.failure``."""
        gathered = flight.start.gather.round if flight.start is not None else None
        judged = self.crew.verdict.judge(result, self.local.state.round, flight.pre_digest, gathered)
        if judged.failure:
            flight.failure = judged.failure
        return judged.lands

    def abandon_if_landed(self, flight: InFlight) -> None:
        """Give up the round in flight if it is still looking for its group and the swarm has
        landed the round it meets at: its group formed without this peer (a peer that adopted a
        state while the swarm moved on, one that launched late), and its window, two phases
        long, would pass at a key nobody comes to any more. The round then fails here as any
        failed round does: this peer re-syncs and keeps its local work. At most every
        ``LANDED_CHECK_S`` (it reads the DHT's digest records)."""
        now = time.monotonic()
        if now < self._landed_check_at or flight.pending.done():
            return
        self._landed_check_at = now + joining.LANDED_CHECK_S
        agreed = self.crew.swarm.accepted_state(exclude=self.crew.identity.public_key)
        if agreed is not None and agreed.round > flight.pending.meets and flight.pending.abandon():
            logger.warning(
                "the swarm landed round %d without this peer (its state is of round %d): giving up the search",
                flight.pending.meets,
                agreed.round,
            )

    def _swarm_moved_on(self) -> bool:
        """Whether the DHT already shows a later agreed round than this peer's (best effort: the
        others may not have published yet; then the next group spots it)."""
        agreed = self.crew.swarm.accepted_state(exclude=self.crew.identity.public_key)
        return agreed is not None and agreed.round > self.local.state.round
