"""Launching a round (``Launcher.launch``): the inner phase's work becomes the pseudo-gradient
Δ = θ_g − θ_local (+ the codec residual), written into the averager's vector, and the round's
averaging starts (``Launcher.start_round``). With overlap (unsharded, a finite model, no eager
start) only the launch point is read on the training thread; Δ is written on the landing thread
while the next inner steps run, and the round starts once it is."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.process_memory import release_free_memory
from peer.node.schedule import inner_lr
from peer.round.device_mirror import DeviceMirror, room_for
from peer.round.host_passes import (
    copy_model_into,
    model_is_finite,
    start_eagerly,
    write_delta_from,
    write_pseudo_gradient,
)
from peer.round.inner import InnerPhase, InnerSteps
from peer.round.joining import Joining
from peer.round.local import Crew, LocalState
from peer.round.resync import outer_at
from peer.round.swarm_port import NEGLIGIBLE_WEIGHT, PendingAverage, RoundResult
from peer.round.timeouts import matchmaking_timeout, matchmaking_window
from peer.round.turn import InTurn, TurnWriter
from peer.task.data_assignment import DataRead
from protocol.gathered import Gathered

logger = logging.getLogger(__name__)


class NotStarted:
    """The pending average of a round whose averaging has not started yet."""

    meets = -1

    def done(self) -> bool:
        return False

    def wait(self, timeout: float) -> bool:
        return False

    def abandon(self) -> bool:
        return False

    def result(self) -> RoundResult | None:
        raise RuntimeError("the round has not started")


NOT_STARTED: Any = NotStarted()


@dataclass(frozen=True)
class Launch:
    """``SwarmPort.start_round``'s arguments for a launched round."""

    weight: float
    gather: Gathered
    timeout: float
    window: float
    joining: bool = False

    def claiming_nothing(self) -> Launch:
        """The same launch taking part with zeros: weight negligible, no samples claimed."""
        return dataclasses.replace(self, weight=NEGLIGIBLE_WEIGHT, gather=dataclasses.replace(self.gather, samples=0))


@dataclass
class InFlight:
    """A launched round: what applying its result (or undoing it) needs."""

    pending: PendingAverage
    compensated: bool
    """Whether the vector sent was Δ + the codec residual (else zeros, or no feedback)."""
    samples: int
    loss: float
    compute_s: float
    pre_digest: str
    launched_at: float
    prep_s: float = 0.0
    """Host time spent preparing the launch (pseudo-gradient and residual written into the
    averager's vector, hand-over)."""
    lr: float = 0.0
    data: DataRead | None = None
    eager: bool = False
    """The next inner phase started at θ̂ (``peer.round.host_passes.start_eagerly``), not the launch point."""
    result: RoundResult | None = None
    """The round's outcome, once known."""
    start: Launch | None = None
    """``SwarmPort.start_round``'s arguments."""
    writing: Future[bool] | None = None
    """The pseudo-gradient being written on the landing thread; the round starts after it."""
    landing: Future[float] | None = None
    """The landing's host half on the landing thread (its seconds), while the inner steps go on."""
    judged_at: float | None = None
    """When its result was judged (monotonic; ``Landing.judge``): its landing's host time runs from here."""
    counted: bool = False
    wait_s: float = 0.0
    host_s: float = 0.0
    """Host time of the landing on the training thread so far."""
    failure: str = ""
    """Why the round did not land here ("" if it did)."""
    carried: int = 0
    """Samples of earlier rounds that failed here whose work this round's pseudo-gradient holds
    (they are in its weight: ``LocalState.unlanded``)."""
    carried_s: float = 0.0
    """Their inner steps' seconds."""
    turn: InTurn | None = None
    """Its fragments in turn (``averaging.sync_fragments`` > 1: ``peer.round.in_turn``)."""

    def due(self) -> bool:
        """Whether its result, and its landing's host half if one runs (or every fragment in
        turn), are ready."""
        if self.turn is not None and not self.turn.complete():
            return False
        return self.pending.done() and (self.landing is None or self.landing.done())


class Launcher:
    """Turns an ended inner phase into a round in flight; owns the launch point and the device
    mirror, and ``phase_s`` (the last trained phase's seconds)."""

    def __init__(self, crew: Crew, local: LocalState, inner: InnerSteps, joining: Joining) -> None:
        self.crew, self.local, self.inner, self.joining = crew, local, inner, joining
        self.in_turn: TurnWriter | None = None
        """Writes rounds' fragments in turn (set by the trainer when the run averages in turn)."""
        self._span_s = 0.0
        """The span of fragments' gates the averager was last told (``SwarmPort.set_sync_span``)."""

    def launch(self, inner: InnerPhase) -> InFlight:
        """Launch the round of the inner phase just ended (its averaging starts now, or once its
        pseudo-gradient is written on the landing thread)."""
        crew, local = self.crew, self.local
        prep_started = time.monotonic()
        samples, loss, compute_s = inner.samples, inner.loss, prep_started - inner.started
        self.inner.release_gradients()  # dead until the next step; the vector they may live in is written now
        weight = float(samples)
        writing: Future[bool] | None = None
        off_thread = (
            crew.options.host_thread and local.launch_point is not None and not crew.ranks.sharded and not crew.eager
        )
        turn: InTurn | None = None
        if self.in_turn is not None and self.in_turn.fragments > 1:
            samples, loss, weight = self._check_finite(samples, loss, weight)
            turn = self.in_turn.begin(zeros=samples == 0)
        elif samples > 0 and off_thread and model_is_finite(local.model):
            assert local.launch_point is not None
            mirror = self.mirrored()
            if mirror is not None:
                mirror.capture(local.model)  # device to device; the landing thread downloads it
            else:
                copy_model_into(local.model, local.launch_point)
            writing = crew.lander.submit(self.write_delta, mirror)
        else:
            samples, loss, weight = self._write_now(samples, loss, weight)
        release_free_memory()  # the inner steps' freed temporaries, held otherwise through the landing
        compensated = samples > 0 and crew.feedback is not None
        eager = crew.eager and samples > 0
        carried, carried_s = local.unlanded if samples > 0 else (0, 0.0)
        if carried:  # this pseudo-gradient holds their work too: weighed and claimed with it
            local.unlanded = (0, 0.0)
            weight = float(samples + carried)
        if eager:
            assert local.launch_point is not None
            outer = outer_at(crew.spec, local.state.round)
            start_eagerly(local.model, local.state, local.launch_point, outer, crew.staging)
        pre_digest = local.state.digest()
        gather = Gathered(
            id=crew.identity.public_key.id,
            round=local.state.round,
            digest=pre_digest,
            samples=samples + carried,
            roster=crew.roster.size,
            known=crew.roster.known,
            link=crew.resync.link,
        )
        logger.info(
            "averaging round %d: %d samples%s, looking for a group",
            local.state.round,
            samples + carried,
            f" ({carried} of rounds that did not land here)" if carried else "",
        )
        timeout, window = self._search(inner, compute_s)
        data = crew.task.data_report(inner.data_round) if crew.task.data_report is not None and inner.done else None
        lr = inner_lr(crew.spec, inner.round, max(0, inner.done - 1))
        flight = InFlight(
            NOT_STARTED, compensated, samples, loss, compute_s, pre_digest, prep_started,
            time.monotonic() - prep_started, lr, data, eager,
        )  # fmt: skip
        flight.start = Launch(weight, gather, timeout, window, joining=inner.joining or not inner.steps)
        flight.carried, flight.carried_s = carried, carried_s
        flight.writing = writing
        flight.turn = turn
        if turn is not None:
            self._tell_span(compute_s)
            turn.host_s = 0.0  # its first fragment's write is in ``prep_s`` already
        if writing is None:
            self.start_round(flight)
        return flight

    def _check_finite(self, samples: int, loss: float, weight: float) -> tuple[int, float, float]:
        """Fragments in turn: a model that is not finite sends zeros, claiming nothing (its local
        work dropped, as ``_write_now`` does); the samples, loss and weight the round claims."""
        if samples and not model_is_finite(self.local.model):
            self.inner.drop_local_work(f"its model went non-finite in round {self.local.state.round}")
            samples, loss = 0, float("nan")
        return samples, loss, (weight if samples else NEGLIGIBLE_WEIGHT)

    def _tell_span(self, compute_s: float) -> None:
        """How far apart the group's members may write a fragment: about an inner phase."""
        span = max(self.local.phase_s or 0.0, compute_s)
        if span and abs(span - self._span_s) > 0.1 * max(self._span_s, 1e-9):
            self.crew.swarm.set_sync_span(span)
            self._span_s = span

    def _write_now(self, samples: int, loss: float, weight: float) -> tuple[int, float, float]:
        """The pseudo-gradient written on the training thread: zeros (taking part to receive the
        average, claiming nothing) when there is no work or it is not finite. The samples, loss
        and weight the round then claims."""
        crew, local = self.crew, self.local
        with crew.swarm.outbox() as out:
            finite = samples > 0 and write_pseudo_gradient(
                local.model,
                local.state.params,
                out,
                feedback=crew.feedback,
                launch_point=local.launch_point,
                staging=crew.staging,
            )
            if samples and not finite:
                self.inner.drop_local_work(f"its model went non-finite in round {local.state.round}")
                samples, loss = 0, float("nan")
            if samples == 0:
                # nothing to contribute: take part with zeros (to receive the average) and claim nothing
                out.zero_()
                weight = NEGLIGIBLE_WEIGHT
                if local.launch_point is not None:
                    copy_model_into(local.model, local.launch_point)
        return samples, loss, weight

    def _search(self, inner: InnerPhase, compute_s: float) -> tuple[float, float]:
        """How long the round may look for its group, and the window it declares."""
        crew, local = self.crew, self.local
        if inner.steps and not inner.joining:
            local.phase_s = compute_s
            timeout = matchmaking_timeout(crew.timeouts, overlap=crew.overlap, compute_s=compute_s)
            return timeout, matchmaking_window(timeout)
        # joining: it waits up to two phases, declared for its whole search so that it closes
        # after the members it joins and follows their leader, which waits for it as a peer
        # declared at the round's key (``engine.matchmaking.JOIN_GRACE_S``). Declared with the
        # members' window a little before them (``JOIN_LEAD_S``), it led them, and a member that
        # had not read its declaration yet when it launched (a store takes a second from a home
        # link) led a group of its own: the round split, the newcomer's group waiting out its
        # window for that member (11 s of an 8 s phase in the lab). An open-run newcomer meeting a
        # round ahead (``SwarmPort.behind``) cannot know when the swarm gets there either:
        # whenever it arrives, it finds the newcomer declared.
        newcomer = crew.swarm.behind(local.state.round)
        timeout = self.joining.join_timeout(newcomer=newcomer)
        if not newcomer:
            timeout = max(timeout, self.joining.follow_timeout())
        return timeout, matchmaking_window(timeout)

    def mirrored(self) -> DeviceMirror | None:
        """The device mirror, decided at the first launch (the inner steps' peak memory is
        reserved by then): made when ``options.device_mirror`` says so or the device has room."""
        crew, local = self.crew, self.local
        if not local.mirror_decided:
            local.mirror_decided = True
            device = next(local.model.parameters()).device
            numel = local.state.params.numel()
            validates = bool(crew.spec.eval.every_rounds) and crew.task.eval_batches is not None
            wanted = crew.options.device_mirror
            if wanted is None:
                wanted = room_for(device, 1, numel)
                validates = validates and room_for(device, 2, numel)
            if wanted:
                local.mirror = DeviceMirror(device, numel, validate=validates)
                logger.info(
                    "the launch point%s stays on %s (%.2f GB of its memory)",
                    " and θ_g" if validates else "",
                    device,
                    local.mirror.nbytes / 1e9,
                )
            elif device.type == "cuda":
                logger.info("no room on %s for the launch point: it moves through pinned host memory", device)
        return local.mirror

    def write_delta(self, mirror: DeviceMirror | None) -> bool:
        """On the landing thread: the launch point from the device mirror (when there is one),
        then the averager's vector ← θ_g − launch point (+ residual)
        (``peer.round.host_passes.write_delta_from``); zeros if that is not finite. Whether it was."""
        crew, local = self.crew, self.local
        assert local.launch_point is not None
        if mirror is not None:
            mirror.download(local.launch_point)
        with crew.swarm.outbox() as out:
            finite = write_delta_from(local.launch_point, local.state.params, out, feedback=crew.feedback)
            if not finite:
                out.zero_()
        return finite

    def start_round(self, flight: InFlight) -> None:
        """Start the launched round's averaging, once its pseudo-gradient is written (waiting
        for the landing thread if need be)."""
        crew, local = self.crew, self.local
        started = time.monotonic()
        if flight.writing is not None:
            finite = flight.writing.result()
            flight.writing = None
            if not finite:  # θ_g, the launch point or the residual: nothing of it can be sent
                self.inner.drop_local_work(f"its pseudo-gradient went non-finite in round {local.state.round}")
                assert local.launch_point is not None
                copy_model_into(local.model, local.launch_point)
                flight.samples, flight.loss, flight.compensated = 0, float("nan"), False
                flight.carried, flight.carried_s = 0, 0.0
                assert flight.start is not None
                flight.start = flight.start.claiming_nothing()
        assert flight.start is not None
        start = flight.start
        flight.pending = crew.swarm.start_round(
            weight=start.weight, gather=start.gather, timeout=start.timeout, window=start.window, joining=start.joining
        )
        if flight.turn is not None:
            assert self.in_turn is not None
            self.in_turn.opened(flight)
        flight.launched_at = time.monotonic()
        flight.prep_s += flight.launched_at - started
