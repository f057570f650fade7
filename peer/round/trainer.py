"""The peer's training loop: DiLoCo inner phase, swarm averaging, outer step.

Per round r (see docs/design/round.md):
1. inner phase: from the round's start point, up to H optimizer steps (or the time budget)
   on this peer's shard; AdamW/SGD, gradient clipping, bf16 autocast on CUDA;
2. pseudo-gradient Δ = θ_g − θ_local, written straight into the averager's shared vector,
   refused (zeros, negligible weight) if not finite; error feedback adds the codec's residual
   from the last round;
3. averaging in the background (hivemind matchmaking + exact all-reduce), weighted by
   samples; with ``overlap`` the next round's inner phase runs meanwhile and the result is
   applied between two inner steps (one-round delay), otherwise the peer waits;
4. outer step on the averaged Δ̄ (Nesterov SGD), identical bytes in every member, then
   θ_local ← θ_g + (progress made since the round was launched); the codec residual of what
   was sent is computed here, when the round is known to have counted. With overlap the host
   half (residual, outer step, the re-base shift) runs on a landing thread while the inner
   steps go on, and only the re-base (θ_local += shift) runs between two inner steps.

Steps 2 and 4 are chunked in-place passes (``peer.round.host_passes``): beyond the training state
a peer holds θ_g, the outer momentum, the averager's vector, the residual (lossy codecs) and,
with overlap, the launch point, plus buffers of one chunk.

A failed round (no group, timeout) changes no global state and no residual: its Δ folds into
the next round; so does its Δ in the ranges of a reducer that failed mid-round (the rest
lands). A peer that finds it started a round from another state than its group's majority is
flagged out of sync.

Each completed round yields a ``RoundMetrics`` (``peer.round.round_metrics``). The trainer talks to
the swarm only through ``peer.round.swarm_port.SwarmPort``. The round's parts each live in a
module of their own and share one record of the peer's local state (``peer.round.local``):
``inner`` (the inner phase), ``launch``, ``landing``, ``adoption`` (re-sync) and ``joining``
(a newcomer's first round); the loop here drives them and alone changes the phase.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.checkpoint import Checkpointer
from engine.codecs import get_codec
from engine.compression import Codec, ErrorFeedback
from peer.node.inner_step import Precision, inner_optimizer
from peer.node.local_ranks import local_ranks
from peer.round.adoption import Adoption
from peer.round.host_passes import Staging
from peer.round.in_turn import FragmentsInTurn, in_turn_bounds
from peer.round.inner import InnerPhase, InnerSteps
from peer.round.joining import Joining
from peer.round.landing import Landed, Landing
from peer.round.launch import InFlight, Launcher
from peer.round.local import Crew, LocalState
from peer.round.options import TrainerOptions
from peer.round.progress import NoProgress, ProgressSink
from peer.round.publisher import DigestPublisher
from peer.round.resync import Resync
from peer.round.roster_book import RosterBook
from peer.round.round_loop import LoopView, Step, next_step, opens_inner, starts_averaging
from peer.round.round_metrics import RoundJournal, RoundMetrics
from peer.round.saving import restore, save
from peer.round.state import GlobalState
from peer.round.swarm_port import StateTaker, SwarmPort
from peer.round.timeouts import AdaptiveTimeouts, matchmaking_timeout
from peer.round.verdict import RoundVerdict
from peer.task import Task
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.spec import RunSpec

__all__ = ["Phase", "Trainer", "TrainerOptions"]

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a peer's round is (``Trainer.phase``)."""

    TRAINING = "training"
    """Inner steps of the current round; with overlap, the previous round may be averaging."""
    AVERAGING = "averaging"
    """Waiting for the round in flight (no overlap, or the inner phase is over)."""
    APPLYING = "applying"
    """The outer step on the group's average (or the undo of a failed round)."""
    RESYNCING = "re-syncing"
    """Adopting the swarm's state from a member (start, out of sync, or the swarm moved on)."""


class Trainer:
    """Runs rounds until ``max_rounds`` or ``options.stop``; ``on_round`` gets each round's metrics.

    A round is a small state machine (``phase``), driven by ``_rounds`` one
    ``peer.round.round_loop.Step`` per turn; each phase's work is a part of its own, and the
    parts share ``local`` (``peer.round.local.LocalState``):

    - ``TRAINING``: ``inner`` (``peer.round.inner.InnerSteps``) owns the inner optimizer, the
      current ``InnerPhase`` and ``inner_steps_done``. When the phase is over, ``launcher``
      (``peer.round.launch``) turns its work into a pseudo-gradient and starts averaging it: an
      ``InFlight`` (the pending round, the launch point, the codec residual before it, the
      pre-round digest).
    - ``AVERAGING`` waits for the in-flight round; with overlap the next ``TRAINING`` runs
      meanwhile and the round lands between two inner steps.
    - ``APPLYING``: ``landing`` (``peer.round.landing``, the only place a round lands) owns
      ``state``, the codec residual, the adaptive timeouts, ``history`` and checkpoints; a
      failed round changes none of them, so its work folds into the next.
    - ``RESYNCING``: ``adoption`` (``peer.round.adoption``) owns ``in_sync`` and the uncounted
      work: it adopts the state the swarm's members agree on, carrying over local work nobody
      counted; ``joining`` (``peer.round.joining``) times a newcomer's first round.
    """

    def __init__(
        self,
        spec: RunSpec,
        task: Task,
        swarm: SwarmPort,
        options: TrainerOptions,
        on_round: Callable[[RoundMetrics], None] | None = None,
        progress: ProgressSink | None = None,
        journal: RoundJournal | None = None,
    ) -> None:
        self.spec, self.task, self.swarm, self.options = spec, task, swarm, options
        sharded_here = options.node is not None and options.shard
        model = task.model if sharded_here else task.model.to(options.device)
        state = GlobalState.from_model(model)
        codec = get_codec(spec.averaging.compression, spec.averaging.density, spec.averaging.bits)
        # a lossless codec has no residual to carry: no feedback (and no full-size zero copies)
        feedback = ErrorFeedback(codec, state.params.numel()) if spec.averaging.error_feedback and codec.lossy else None
        ranks = local_ranks(options.node, model, shard=options.shard)
        self.local = local = LocalState(model, state, inner_optimizer(spec, ranks.forward), None)
        overlap = spec.averaging.overlap if options.overlap is None else options.overlap
        in_turn = len(in_turn_bounds(spec, state.params.numel())) > 1
        if in_turn and ranks.sharded:
            raise ConfigError(
                "averaging.sync_fragments > 1 is not supported on a node that shards its model over "
                "local ranks yet: run it with --fsdp off, or a spec with sync_fragments = 1"
            )
        if overlap and not in_turn:  # (in turn: a fragment's launch point at a time, ``peer.round.in_turn``)
            local.launch_point = local.host_vector()
        checkpointer = (
            Checkpointer(options.checkpoint_dir, spec_digest=spec.digest(), spec=spec)
            if options.checkpoint_dir
            else None
        )
        if checkpointer is not None:
            restore(checkpointer, local, feedback=feedback, sharded=ranks.sharded, journal=journal)
        identity = options.identity or Identity.generate()
        progress = progress or NoProgress()
        roster = RosterBook()
        snapshot = (local.state.round, local.state.digest(), local.resumed_landed)
        self.crew = Crew(
            spec, task, swarm, options, identity, codec, feedback, ranks,
            Precision.for_device(options.device), Staging(model), roster, RoundVerdict(spec, swarm, roster),
            Resync(spec, swarm, identity.public_key, lambda: self.crew.codec, options.stop, progress),
            AdaptiveTimeouts(spec.averaging.matchmaking_timeout_s, spec.averaging.allreduce_timeout_s),
            DigestPublisher(swarm, identity, roster, snapshot), checkpointer, journal, progress,
            on_round or (lambda metrics: None),
        )  # fmt: skip
        self.adoption = Adoption(self.crew, local)
        self.joining = Joining(self.crew, local, self.adoption)
        self.inner = InnerSteps(self.crew, local, self.joining)
        self.launcher = Launcher(self.crew, local, self.inner, self.joining)
        self.landing = Landing(self.crew, local, self.inner, self.adoption)
        self.in_turn = FragmentsInTurn(self.crew, local, self.landing)
        if in_turn:
            self.launcher.in_turn = self.in_turn
        self.phase = Phase.RESYNCING
        swarm.serve_state(self._serve)

    # the parts' records, as the trainer's own attributes (the CLI, tests and benchmarks read them)
    @property
    def state(self) -> GlobalState:
        return self.local.state

    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.local.optimizer

    @property
    def history(self) -> list[RoundMetrics]:
        return self.local.history

    @property
    def in_sync(self) -> bool:
        return self.local.in_sync

    @in_sync.setter
    def in_sync(self, value: bool) -> None:
        self.local.in_sync = value

    @property
    def missed_end(self) -> int | None:
        return self.local.missed_end

    @property
    def inner_steps_done(self) -> int:
        return self.local.inner_steps_done

    @property
    def codec(self) -> Codec:
        return self.crew.codec

    @codec.setter
    def codec(self, value: Codec) -> None:
        self.crew.codec = value

    @property
    def feedback(self) -> ErrorFeedback | None:
        return self.crew.feedback

    @feedback.setter
    def feedback(self, value: ErrorFeedback | None) -> None:
        self.crew.feedback = value

    @property
    def timeouts(self) -> AdaptiveTimeouts:
        return self.crew.timeouts

    @timeouts.setter
    def timeouts(self, value: AdaptiveTimeouts) -> None:
        self.crew.timeouts = value

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.crew.checkpointer

    @checkpointer.setter
    def checkpointer(self, value: Checkpointer | None) -> None:
        self.crew.checkpointer = value

    @property
    def on_round(self) -> Callable[[RoundMetrics], None]:
        return self.crew.on_round

    @on_round.setter
    def on_round(self, value: Callable[[RoundMetrics], None]) -> None:
        self.crew.on_round = value

    @property
    def roster(self) -> RosterBook:
        return self.crew.roster

    @property
    def identity(self) -> Identity:
        return self.crew.identity

    @property
    def publisher(self) -> DigestPublisher:
        return self.crew.publisher

    @property
    def overlap(self) -> bool:
        return self.crew.overlap

    def save_checkpoint(self) -> None:
        save(self.crew, self.local)

    def matchmaking_timeout(self, compute_s: float) -> float:
        """How long a round launched after a phase of ``compute_s`` may look for its group."""
        return matchmaking_timeout(self.crew.timeouts, overlap=self.crew.overlap, compute_s=compute_s)

    def run(self) -> list[RoundMetrics]:
        """Re-sync, wait for the group, then train rounds until done; the rounds' metrics."""
        self.catch_up()
        if self.local.missed_end is None:
            self.wait_for_group()
        try:
            history = self._rounds()
            if self.local.in_sync:  # a clean stop: the record of its state says it leaves
                self.crew.publisher.say_leaving()
            return history
        finally:  # the landing thread ends with the run, however it ends
            self.inner.release_gradients()
            self.crew.lander.shutdown()

    def _rounds(self) -> list[RoundMetrics]:
        """The round loop: each turn does what ``peer.round.round_loop.next_step`` says."""
        flight: InFlight | None = None
        inner: InnerPhase | None = None
        stop = self.options.stop
        while True:
            self.landing.record_landed(wait=False)
            more = not stop.is_set() and not self._finished(flight)
            if opens_inner(inner=inner is not None, more=more, flight=flight is not None, overlap=self.overlap):
                inner = self.inner.open(ahead=flight is not None)
            training = inner is not None and not inner.over(stop)
            writing = flight.writing if flight is not None else None
            if flight is not None and starts_averaging(
                writing=writing is not None, written=writing is not None and writing.done(), training=training
            ):
                self.launcher.start_round(flight)
            if flight is not None and training and flight.writing is None:
                self.landing.abandon_if_landed(flight)
            if flight is not None and flight.turn is not None and training:
                self.in_turn.advance(flight, inner, wait=False)
            step = next_step(
                LoopView(
                    inner=inner is not None,
                    training=training,
                    flight=flight is not None,
                    due=flight is not None and flight.due(),
                    leaving_out_of_sync=stop.is_set() and not self.local.in_sync,
                )
            )
            if step is not Step.TRAIN:
                self.crew.ranks.host_work_next(self.model)  # (sharded ranks: gathered into the model)
            if step is Step.LAND:
                assert flight is not None
                if self._land(flight, wait=not training):
                    flight = None
                elif inner is not None:  # the landing's host half runs meanwhile
                    self._train_step(inner)
            elif step is Step.TRAIN:
                assert inner is not None
                self._train_step(inner)
            elif step is Step.LAUNCH:
                assert inner is not None
                self.landing.record_landed(wait=True)  # the launch states the digest of the state it starts from
                flight, inner = self.launcher.launch(inner), None
            elif step is Step.DISCARD:
                assert inner is not None
                logger.info("leaving out of sync: not launching round %d", self.local.state.round)
                self.inner.release_gradients()
                self.landing.record_landed(wait=True)
                inner = None
            else:
                self.landing.record_landed(wait=True)
                return self.local.history

    def _train_step(self, inner: InnerPhase) -> None:
        self.phase = Phase.TRAINING
        self.inner.step(inner)

    def _land(self, flight: InFlight, *, wait: bool) -> bool:
        """Land the round in flight (waiting for its result if need be); True once done. With
        overlap, unless ``wait``, False while its host half runs (the inner steps go on)."""
        if flight.writing is not None:
            self.launcher.start_round(flight)
        if flight.turn is not None and not flight.turn.complete():
            self.phase = Phase.AVERAGING
            self.in_turn.advance(flight, None, wait=True)
        if flight.landing is None:
            if self.landing.waits(flight):
                since = time.monotonic()
                self.phase = Phase.AVERAGING
                self.crew.progress.waiting(self.local.state.round)
                self.landing.await_result(flight, since=since)
            self.landing.judge(flight)
            self.phase = Phase.APPLYING
        elif not flight.landing.done():
            self.phase = Phase.APPLYING
        landed = self.landing.land(flight, wait=wait)
        if landed is Landed.OUT_OF_SYNC:  # re-synced here, on the round's host time (its row comes after)
            started = time.monotonic()
            self.catch_up()
            flight.host_s += time.monotonic() - started
            self.landing.record(flight)
        return landed is not Landed.RUNNING

    def _finished(self, in_flight: InFlight | None) -> bool:
        local, run = self.options.max_rounds, self.spec.rounds.max_rounds
        # a round whose landing's host half runs is not in ``state.round`` yet either
        flying = 1 if in_flight is not None else 0
        # a landed round whose digest is still being hashed is in ``state.round`` already, not yet in ``history``
        unrecorded = 1 if self.landing.unrecorded is not None else 0
        return (
            self.local.missed_end is not None
            or (local is not None and len(self.local.history) + flying + unrecorded >= local)
            or (run is not None and self.local.state.round + flying >= run)
        )

    def _serve(self, take: StateTaker) -> dict[str, Any]:
        """The state to hand a peer that downloads it, taken (written to its file,
        ``engine.state_snapshot``) without holding the state's lock: a write at the disk's pace
        (a big model on a slow disk) never holds up a landing. A landing that went on meanwhile
        tore what was written: then nothing is served (the downloader asks another member; had it
        been served, its digest check would have refused it)."""
        with self.local.state_lock:
            if self.local.between_rounds:
                raise RuntimeError("a round is landing fragment by fragment: the state is between two rounds")
            state = self.local.state
            round_, digest = state.round, state.digest()
        served = take(round_, state.params, state.momentum, digest)
        with self.local.state_lock:
            if (
                self.local.state is state
                and state.round == round_
                and state.digest_ready()
                and not self.local.between_rounds
            ):
                if state.digest() == digest:
                    return served
        raise RuntimeError(f"the state of round {round_} changed while it was written for a download")

    def wait_for_group(self) -> bool:
        """Wait (up to ``options.wait_for_group_s``) until ``min_group_size`` peers, this one
        included, published a digest for this peer's round. True if they did."""
        return self.adoption.wait_for_group()

    def catch_up(self) -> bool:
        """Adopt the swarm's latest state if ours is not it (``Adoption.catch_up``). True if we
        hold the swarm's state."""
        self.phase = Phase.RESYNCING
        return self.adoption.catch_up()
