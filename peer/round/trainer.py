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
the swarm only through ``peer.round.swarm_port.SwarmPort``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import Checkpointer
from engine.codecs import get_codec
from engine.compression import ErrorFeedback
from peer.node.inner_step import Precision, inner_optimizer, inner_step
from peer.node.local_ranks import local_ranks
from peer.node.node import LocalNode
from peer.node.schedule import inner_lr
from peer.round.device_mirror import DeviceMirror, room_for
from peer.round.host_passes import (
    Staging,
    copy_model_into,
    land_global,
    land_round,
    model_is_finite,
    rebase_model,
    start_eagerly,
    undo_eager_start,
    write_delta_from,
    write_pseudo_gradient,
)
from peer.round.progress import InnerProgress, NoProgress, ProgressSink
from peer.round.publisher import DigestPublisher
from peer.round.resync import Resync, outer_at
from peer.round.roster_book import RosterBook
from peer.round.round_loop import LoopView, Step, next_step, opens_inner, starts_averaging
from peer.round.round_metrics import RoundJournal, RoundMetrics
from peer.round.state import GlobalState, flatten, load_flat
from peer.round.swarm_port import NEGLIGIBLE_WEIGHT, PendingAverage, RoundResult, SwarmPort
from peer.round.timeouts import AdaptiveTimeouts, matchmaking_window, search_for_window
from peer.round.verdict import RoundVerdict
from peer.task import Task
from peer.task.data_assignment import DataRead
from protocol.errors import VerificationError
from protocol.gathered import Gathered
from protocol.identity import Identity
from protocol.spec import OuterSection, RunSpec
from protocol.statesync import RECORD_TTL_S

logger = logging.getLogger(__name__)


REPUBLISH_S = RECORD_TTL_S / 4
"""A peer re-signs its digest record this often while a round runs, so that rounds longer than
the record's lifetime never leave newcomers without votes."""
LANDED_CHECK_S = 2.0
"""While a round looks for its group, how often the peer reads the digest records to learn
whether the swarm landed that round without it (``Trainer._abandon_if_landed``)."""
JOIN_LEAD_S = 0.5
"""A peer that adopted a state ends its first phase this long, plus twice its recent DHT lookup
time (``Swarm.lookup_s``), before the members holding it end theirs (``Trainer._swarm_launches_at``),
so that its declaration is stored where their leader looks when they launch: its last inner step
may overrun the phase, the members' landing times are signed to the millisecond but by clocks
that differ a little, and on a home link a store takes about a second (a newcomer that declared
0.5 s ahead on a 250 kbit/s link was not seen)."""
FOLLOW_MARGIN_S = 1.0
"""How much later than the members it joins a joining round declares to close
(``Trainer._follow_timeout``): the members' adaptive deadlines differ a little from its own."""
MAX_CARRIED_ROUNDS = 2
"""A peer that re-syncs carries its uncounted local work over to the adopted state only if that
state is at most this many rounds ahead of the one the work started from (staler work is dropped)."""


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


@dataclass
class _InnerPhase:
    """The inner steps of one round so far."""

    started: float
    deadline: float
    steps: int
    round: int
    """The round these steps train for (their learning rate): the state's round, or the next
    one while the previous round still averages (overlap)."""
    data_round: int
    """The round of the data assignment these steps read (token runs): ``round``, but never
    one this peer already read (after a failed round the same ``round`` trains again, on the
    next pages: a failed round's work is folded into the next, so re-reading would count a
    page twice)."""
    done: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    joining: bool = False
    """A phase cut to end as the swarm's members end theirs (``Trainer._swarm_launches_at``): its
    round is launched as a join (``Trainer._join_timeout``)."""
    least: int = 0
    """Steps taken whatever the deadline (a joining phase's one)."""

    def over(self, stop: threading.Event) -> bool:
        if stop.is_set() or self.done >= self.steps:
            return True
        return self.done >= self.least and time.monotonic() >= self.deadline

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.done, 1)


class _NotStarted:
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


_NOT_STARTED: Any = _NotStarted()


@dataclass(frozen=True)
class _Launch:
    """``SwarmPort.start_round``'s arguments for a launched round."""

    weight: float
    gather: Gathered
    timeout: float
    window: float
    joining: bool = False

    def claiming_nothing(self) -> _Launch:
        """The same launch taking part with zeros: weight negligible, no samples claimed."""
        return dataclasses.replace(self, weight=NEGLIGIBLE_WEIGHT, gather=dataclasses.replace(self.gather, samples=0))


@dataclass
class _InFlight:
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
    start: _Launch | None = None
    """``SwarmPort.start_round``'s arguments."""
    writing: Future[bool] | None = None
    """The pseudo-gradient being written on the landing thread; the round starts after it."""
    landing: Future[float] | None = None
    """The landing's host half on the landing thread (its seconds), while the inner steps go on."""
    counted: bool = False
    wait_s: float = 0.0
    host_s: float = 0.0
    """Host time of the landing on the training thread so far."""
    failure: str = ""
    """Why the round did not land here ("" if it did)."""
    carried: int = 0
    """Samples of earlier rounds that failed here whose work this round's pseudo-gradient holds
    (they are in its weight: ``Trainer._unlanded``)."""
    carried_s: float = 0.0
    """Their inner steps' seconds."""

    def due(self) -> bool:
        """Whether its result, and its landing's host half if one runs, are ready."""
        return self.pending.done() and (self.landing is None or self.landing.done())


@dataclass
class _Landed:
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


@dataclass
class TrainerOptions:
    """Knobs of one peer that are not part of the run spec."""

    identity: Identity | None = None
    """This peer's key: signs its digest records (a fresh one if not given)."""
    max_rounds: int | None = None
    """Stop after this many rounds in this process (the run itself ends at the spec's
    rounds.max_rounds global rounds)."""
    device: str = "cpu"
    """Torch device of the inner phase."""
    overlap: bool | None = None
    """Override the spec's averaging.overlap."""
    host_thread: bool = True
    """With overlap, write the launch's pseudo-gradient and run the landing's host half on the
    landing thread while the inner steps go on. False: on the training thread, so that the
    inner step at which a round lands depends on the swarm alone (in-process benchmarks that
    must be a pure function of spec and seed, ``benchmarks/quality_runs.py``)."""
    checkpoint_dir: Path | None = None
    """Save a checkpoint here after every ``checkpoint_every`` rounds and resume from it."""
    checkpoint_every: int = 1
    """Rounds between checkpoints."""
    wait_for_group_s: float = 60.0
    """Before the first round, wait up to this long for ``min_group_size`` peers (this one
    included) to be in the swarm, so that a swarm starting together averages from round 0
    instead of each peer training its first round alone. 0 disables."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set to finish the current round cleanly and return."""
    node: LocalNode | None = None
    """This peer's local ranks when it is the leader of several (``peer.node.node``); None: one rank."""
    shard: bool = False
    """With ``node``: FSDP2-shard the model over the local ranks instead of replicating it (DDP)."""
    device_mirror: bool | None = None
    """With overlap, keep the launch point (and θ_g for the validation) on the model's device
    (``peer.round.device_mirror``): None where a CUDA device has room once the first inner phase ran,
    True always (any device: tests), False never."""


class Trainer:
    """Runs rounds until ``max_rounds`` or ``options.stop``; ``on_round`` gets each round's metrics.

    A round is a small state machine (``phase``), driven by ``_rounds`` one
    ``peer.round.round_loop.Step`` per turn:

    - ``TRAINING`` owns the model, the inner optimizer, the current ``_InnerPhase`` and
      ``inner_steps_done``. When the inner phase is over, ``_launch`` turns its work into a
      pseudo-gradient and starts averaging it: an ``_InFlight`` (the pending round, the launch
      point, the codec residual before it, the pre-round digest).
    - ``AVERAGING`` waits for the in-flight round; with overlap the next ``TRAINING`` runs
      meanwhile and the round lands between two inner steps.
    - ``APPLYING`` (``_finish``, the only place a round lands) owns ``state`` (θ_g, outer
      momentum, round, changed in place under ``_state_lock``), the codec residual, the adaptive timeouts, ``history``
      and checkpoints: the outer step on the average, re-basing the progress made since the
      launch and the codec residual of what was sent; a failed round changes none of them, so
      its work folds into the next.
    - ``RESYNCING`` (``catch_up``) owns ``in_sync`` and ``_uncounted``: it adopts the state
      the swarm's members agree on, carrying over local work nobody counted.
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
        self.on_round = on_round or (lambda metrics: None)
        self.journal = journal
        """Told when a round begins to land and which state this peer holds (the reports)."""
        self.progress: ProgressSink = progress or NoProgress()
        # sharded over local ranks, this is the leader's plain full copy (host memory), and the
        # ranks train FSDP2 shards of it on their devices (``peer.node.node``)
        self.model = task.model if options.node is not None and options.shard else task.model.to(options.device)
        self.state = GlobalState.from_model(self.model)
        self._state_lock = threading.Lock()
        """Held while the state changes in place or is copied for serving."""
        self._staging = Staging(self.model)
        self.codec = get_codec(spec.averaging.compression, spec.averaging.density, spec.averaging.bits)
        # a lossless codec has no residual to carry: no feedback (and no full-size zero copies)
        use_feedback = spec.averaging.error_feedback and self.codec.lossy
        self.feedback = ErrorFeedback(self.codec, self.state.params.numel()) if use_feedback else None
        self.ranks = local_ranks(options.node, self.model, shard=options.shard)
        """This node's local ranks (``peer.node.local_ranks``): inner steps run ``ranks.forward``."""
        self.optimizer = inner_optimizer(spec, self.ranks.forward)
        self.precision = Precision.for_device(options.device)
        self.overlap = spec.averaging.overlap if options.overlap is None else options.overlap
        self._launch_point = self._host_vector() if self.overlap else None
        """With overlap, θ_local at the launch of the round in flight (training moves on meanwhile)."""
        self._mirror: DeviceMirror | None = None
        """With overlap, the launch point (and θ_g) on the model's device, where it has room
        (made at the first launch: ``_mirrored``)."""
        self._mirror_decided = False
        self._landed_check_at = 0.0
        """When ``_abandon_if_landed`` may read the records again."""
        self.eager = self.overlap and spec.averaging.overlap_start == "eager"
        """With overlap, the next inner phase starts at θ̂, not at the launch point."""
        self.in_sync = True
        self.missed_end: int | None = None
        """The run's final round, when the swarm landed it without this peer and nobody serves
        its state any more: the run is over for this peer too (``catch_up``)."""
        self.roster = RosterBook()
        """The roster of the state this peer holds (``protocol.roster``): gathered each round."""
        self.verdict = RoundVerdict(spec, swarm, self.roster)
        """Whether each round's result is the round's one state here (``peer.round.verdict``)."""
        self._launch_now = False
        """Set when this peer adopted a downloaded state: its next round launches at once (no
        samples) so that it is in the swarm's next group and so in its roster; the others
        launch when their phase ends, and a roster that is complete does not wait for a late
        peer outside it."""
        self._carry_over: torch.Tensor | None = None
        """Local work carried onto an adopted state, held out of the round launched at once
        (it sends nothing) and added back to the model once that round lands."""
        self._phase_s: float | None = None
        """How long this peer's last inner phase that trained took (the join round's deadline)."""
        self._uncounted: torch.Tensor | None = None
        """Work of a round that this peer's group weighed 0 (it started from a stale state)."""
        self._unlanded = (0, 0.0)
        """Samples (and their inner steps' seconds) of rounds that did not land here, whose work
        is still in the model (or carried onto an adopted state): the next round that sends it
        weighs and claims them too, since its pseudo-gradient holds them."""
        self.inner_steps_done = 0
        self._data_round = -1
        """The last data round an inner phase read (``_InnerPhase.data_round``); checkpointed."""
        self.history: list[RoundMetrics] = []
        self._landed: _Landed | None = None
        self._lander: ThreadPoolExecutor | None = None
        """The landing thread (overlap), made at the first landing."""
        self.phase = Phase.RESYNCING
        self.identity = options.identity or Identity.generate()
        self.resync = Resync(spec, swarm, self.identity.public_key, lambda: self.codec, options.stop, self.progress)
        """Finds the swarm's state (``peer.round.resync``); its ``link``, the bytes a second this
        peer's link carries (its last state download, waits included: a low estimate), is stated
        to its groups (``Gathered.link``), which stretch a round's deadlines to their slowest
        member's (``engine.link_timeouts``)."""
        self.timeouts = AdaptiveTimeouts(spec.averaging.matchmaking_timeout_s, spec.averaging.allreduce_timeout_s)
        self.checkpointer = (
            Checkpointer(options.checkpoint_dir, spec_digest=spec.digest(), spec=spec)
            if options.checkpoint_dir
            else None
        )
        self._resumed_landed: float | None = None
        """When this peer landed the state its checkpoint holds (None: adopted, or no checkpoint)."""
        if self.checkpointer is not None:
            self._restore()
        self.publisher = DigestPublisher(
            swarm, self.identity, self.roster, (self.state.round, self.state.digest(), self._resumed_landed)
        )
        """This peer's digest record (``peer.round.publisher``)."""
        swarm.serve_state(self._serve)

    def _restore(self) -> None:
        assert self.checkpointer is not None
        record = self.checkpointer.latest()
        if record is None:
            return
        self.state = GlobalState(record["params"], record["momentum"], record["round"])
        self.model.load_state_dict(record["model"])
        if self.ranks.sharded or record.get("inner_optimizer") is None:
            # sharded: each rank holds its shard of the optimizer state, and the checkpoint none
            logger.info("the inner optimizer starts afresh (the checkpoint holds no state for it)")
        else:
            self.optimizer.load_state_dict(record["inner_optimizer"])
        if self.feedback is not None and record.get("residual") is not None:
            self.feedback.load_residual(record["residual"])
        self.inner_steps_done = int(record["inner_steps_done"])
        self._data_round = int(record.get("data_round", -1))
        landed = record.get("landed")
        self._resumed_landed = float(landed) if isinstance(landed, (int, float)) and math.isfinite(landed) else None
        logger.info("resumed from the checkpoint of round %d (%s)", self.state.round, self.state.digest()[:19])
        if self.journal is not None:
            self.journal.holds(self.state.round, self.state.digest())

    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        self.checkpointer.save(
            {
                "round": self.state.round,
                "params": self.state.params,
                "momentum": self.state.momentum,
                "model": self.model.state_dict(),
                # sharded over local ranks, the state is spread over the ranks: not kept (a
                # restarted node's inner optimizer starts afresh, as after a dropped model)
                "inner_optimizer": None if self.ranks.sharded else self.optimizer.state_dict(),
                "residual": self.feedback.state if self.feedback is not None else None,
                "inner_steps_done": self.inner_steps_done,
                "data_round": self._data_round,
                # when this peer landed this state by averaging (None: adopted): resumed, its
                # digest record says so again, or a group beside it that lost its roster could
                # take the round for unlanded (``protocol.roster.landed_beside``)
                "landed": self.publisher.landed_at(self.state.round, self.state.digest()),
            },
            digest=self.state.digest(),
        )

    def run(self) -> list[RoundMetrics]:
        """Re-sync, wait for the group, then train rounds until done; the rounds' metrics."""
        self.catch_up()
        if self.missed_end is None:
            self.wait_for_group()
        try:
            history = self._rounds()
            self._say_leaving()
            return history
        finally:  # the landing thread ends with the run, however it ends
            if self._lander is not None:
                self._lander.shutdown(wait=True)
                self._lander = None

    def _rounds(self) -> list[RoundMetrics]:
        """The round loop: each turn does what ``peer.round.round_loop.next_step`` says."""
        flight: _InFlight | None = None
        inner: _InnerPhase | None = None
        while True:
            self._record_landed(wait=False)
            more = not self.options.stop.is_set() and not self._finished(flight)
            if opens_inner(inner=inner is not None, more=more, flight=flight is not None, overlap=self.overlap):
                inner = self._start_inner(ahead=flight is not None)
            training = inner is not None and not inner.over(self.options.stop)
            writing = flight.writing if flight is not None else None
            if flight is not None and starts_averaging(
                writing=writing is not None, written=writing is not None and writing.done(), training=training
            ):
                self._start_round(flight)
            if flight is not None and training and flight.writing is None:
                self._abandon_if_landed(flight)
            step = next_step(
                LoopView(
                    inner=inner is not None,
                    training=training,
                    flight=flight is not None,
                    due=flight is not None and flight.due(),
                    leaving_out_of_sync=self.options.stop.is_set() and not self.in_sync,
                )
            )
            if step is not Step.TRAIN:
                self._host_work_next()
            if step is Step.LAND:
                assert flight is not None
                if self._finish(flight, wait=not training):
                    flight = None
                elif inner is not None:  # the landing's host half runs meanwhile
                    self._train_step(inner)
            elif step is Step.TRAIN:
                assert inner is not None
                self._train_step(inner)
            elif step is Step.LAUNCH:
                assert inner is not None
                self._record_landed(wait=True)  # the launch states the digest of the state it starts from
                flight, inner = self._launch(inner), None
            elif step is Step.DISCARD:
                assert inner is not None
                logger.info("leaving out of sync: not launching round %d", self.state.round)
                self._record_landed(wait=True)
                inner = None
            else:
                self._record_landed(wait=True)
                return self.history

    def _finished(self, in_flight: _InFlight | None) -> bool:
        local, run = self.options.max_rounds, self.spec.rounds.max_rounds
        # a round whose landing's host half runs is not in ``state.round`` yet either
        flying = 1 if in_flight is not None else 0
        # a landed round whose digest is still being hashed is in ``state.round`` already, not yet in ``history``
        unrecorded = 1 if self._landed is not None else 0
        return (
            self.missed_end is not None
            or (local is not None and len(self.history) + flying + unrecorded >= local)
            or (run is not None and self.state.round + flying >= run)
        )

    def _start_inner(self, *, ahead: bool) -> _InnerPhase:
        rounds = self.spec.rounds
        started = time.monotonic()
        deadline = started + rounds.time_budget_s if rounds.time_budget_s else math.inf
        self.model.train()
        round_ = self.state.round + (1 if ahead else 0)
        if not ahead and (self._launch_now or self.swarm.behind(self.state.round)):
            if self._launch_now and self._too_late_to_join() and not self.roster.known:
                self._join_the_next_round()
            launch = self._swarm_launches_at(self.state.round) if self._launch_now else None
            self._launch_now = False
            if launch is None or launch <= started:
                # join the swarm's next round now, with nothing to contribute (no data round read)
                return _InnerPhase(started, started, 0, round_, self._data_round)
            # train until the members end their phase of this round, and join it with that work:
            # at least one step, so that the round it joins counts its work (a step is a small
            # share of a round; its declaration is that much later)
            self._carry_over = None  # the work carried over is in the model: this phase's Δ holds it
            self._data_round = max(round_, self._data_round + 1)
            # declared before the members launch: its declaration takes about a lookup to be seen
            until = max(started, launch - JOIN_LEAD_S - 2 * self.swarm.lookup_s())
            steps = rounds.inner_steps or 1 << 62
            return _InnerPhase(started, until, steps, round_, self._data_round, joining=True, least=1)
        self._data_round = max(round_, self._data_round + 1)
        return _InnerPhase(started, deadline, rounds.inner_steps or 1 << 62, round_, self._data_round)

    def _swarm_launches_at(self, round_: int) -> float | None:
        """When (monotonic) the members holding the state of ``round_`` end its inner phase and
        launch the round: they landed it when their digest records say (``Swarm.seen_at``), and
        their phase lasts the spec's time budget. None when that is unknown (no time budget, the
        records unseen): then a peer that just adopted the state joins the round at once, with
        nothing to contribute."""
        budget = self.spec.rounds.time_budget_s
        seen = self.swarm.seen_at(round_)
        if not budget or seen is None:
            return None
        return seen + budget

    def _too_late_to_join(self) -> bool:
        """Whether the members holding this peer's just-adopted state have launched its round
        already: a search launched now would come after their group formed. Not
        asked of a peer in the roster of the state it adopted (its group made the state without
        it, ``RosterBook.adopted``): that round's leader waits for it by name, so it joins at once
        (a member whose all-reduce failed once cost the round its leader's whole window so)."""
        launch = self._swarm_launches_at(self.state.round)
        return launch is not None and time.monotonic() >= launch

    def _join_the_next_round(self) -> None:
        """Wait (up to two phases and a matchmaking timeout) for the swarm to land the round this
        peer came too late for, and roll its state forward by that round's update: it then joins
        the next round from its start (``_swarm_launches_at``) rather than search after a group
        that formed without it (its search would be given up, ``_abandon_if_landed``, and hold
        up the next)."""
        budget = self.spec.rounds.time_budget_s or 0.0
        deadline = time.monotonic() + 2 * budget + self.spec.averaging.matchmaking_timeout_s
        logger.info("round %d is under way without this peer: joining the next", self.state.round)
        digest, records_at = self.state.digest(), time.monotonic() + LANDED_CHECK_S
        timeout = self.spec.averaging.allreduce_timeout_s
        while not self.options.stop.is_set() and time.monotonic() < deadline:
            # the round's update, asked for as soon as it lands: members keep it once they hold
            # its state (a read of the records takes seconds on a home link, an ask a round trip)
            update = self.swarm.download_update(self.state.round, digest, timeout=timeout)
            if update is not None:
                rolled = self.resync.roll_forward(self.state.clone(), None, verified=None, first=update)
                if rolled is not None and rolled.state.round > self.state.round:
                    # ``_launch_now`` again
                    self._adopt(rolled.state, accepted={rolled.state.digest()}, through=rolled.through)
                return
            if time.monotonic() >= records_at:  # members that keep no updates: the records say it landed
                records_at = time.monotonic() + LANDED_CHECK_S
                agreed = self.swarm.accepted_state(exclude=self.identity.public_key)
                if agreed is not None and agreed.round > self.state.round:
                    return
            time.sleep(0.25)

    def _train_step(self, inner: _InnerPhase) -> None:
        self.phase = Phase.TRAINING
        inner.loss_sum += self._inner_step(inner)
        inner.samples += self.task.samples_per_batch * self.ranks.world_size
        inner.done += 1
        if time.monotonic() - self.publisher.published_at >= REPUBLISH_S:
            self.publisher.republish()
        rounds = self.spec.rounds
        self.progress.inner_step(
            InnerProgress(
                self.state.round,
                inner.done,
                rounds.inner_steps,
                time.monotonic() - inner.started,
                rounds.time_budget_s,
                inner.samples,
                inner.loss,
            )
        )

    def _host_work_next(self) -> None:
        """The next step reads or changes ``self.model`` outside an inner step (a launch, a
        landing, a re-sync): with sharded local ranks gather the shards into it first; either
        way the other ranks must take it again before the next inner step."""
        self.ranks.host_work_next(self.model)

    def _inner_step(self, inner: _InnerPhase) -> float:
        round_, step, data_round = inner.round, inner.done, inner.data_round
        self.ranks.before_step(self.model, self.optimizer, round_=round_, step=step, data_round=data_round)
        loss = inner_step(
            self.ranks.forward,
            self.optimizer,
            self.task,
            self.spec,
            round_=round_,
            step=step,
            data_round=data_round,
            precision=self.precision,
        )
        self.inner_steps_done += 1
        return self.ranks.mean(loss)

    def _launch(self, inner: _InnerPhase) -> _InFlight:
        """Launch the round of the inner phase just ended. With overlap (unsharded, a finite model,
        no eager start) only the launch point is read here; the pseudo-gradient is written on the
        landing thread while the next inner steps run, and the round starts once it is
        (``_start_round``)."""
        prep_started = time.monotonic()
        samples, loss, compute_s = inner.samples, inner.loss, prep_started - inner.started
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are dead until the next step
        weight = float(samples)
        writing: Future[bool] | None = None
        off_thread = (
            self.options.host_thread and self._launch_point is not None and not self.ranks.sharded and not self.eager
        )
        if samples > 0 and off_thread and model_is_finite(self.model):
            assert self._launch_point is not None
            mirror = self._mirrored()
            if mirror is not None:
                mirror.capture(self.model)  # device to device; the landing thread downloads it
            else:
                copy_model_into(self.model, self._launch_point)
            writing = self._landing_thread().submit(self._write_delta, mirror)
        else:
            with self.swarm.outbox() as out:
                finite = samples > 0 and write_pseudo_gradient(
                    self.model,
                    self.state.params,
                    out,
                    feedback=self.feedback,
                    launch_point=self._launch_point,
                    staging=self._staging,
                )
                if samples and not finite:
                    self._drop_local_work(f"its model went non-finite in round {self.state.round}")
                    samples, loss = 0, float("nan")
                if samples == 0:
                    # nothing to contribute: take part with zeros (to receive the average) and claim nothing
                    out.zero_()
                    weight = NEGLIGIBLE_WEIGHT
                    if self._launch_point is not None:
                        copy_model_into(self.model, self._launch_point)
        compensated = samples > 0 and self.feedback is not None
        eager = self.eager and samples > 0
        carried, carried_s = self._unlanded if samples > 0 else (0, 0.0)
        if carried:  # this pseudo-gradient holds their work too: weighed and claimed with it
            self._unlanded = (0, 0.0)
            weight = float(samples + carried)
        if eager:
            assert self._launch_point is not None
            start_eagerly(self.model, self.state, self._launch_point, self._outer(), self._staging)
        pre_digest = self.state.digest()
        gather = Gathered(
            id=self.identity.public_key.id,
            round=self.state.round,
            digest=pre_digest,
            samples=samples + carried,
            roster=self.roster.size,
            known=self.roster.known,
            link=self.resync.link,
        )
        logger.info(
            "averaging round %d: %d samples%s, looking for a group",
            self.state.round,
            samples + carried,
            f" ({carried} of rounds that did not land here)" if carried else "",
        )
        if inner.steps and not inner.joining:
            self._phase_s = compute_s
            timeout = self.matchmaking_timeout(compute_s)
            window = matchmaking_window(timeout)
        else:
            # joining: it waits up to two phases, declared for its whole search so that it closes
            # after the members it joins and follows their leader, which waits for it as a peer
            # declared at the round's key (``engine.matchmaking.JOIN_GRACE_S``). Declared with the
            # members' window a little before them (``JOIN_LEAD_S``), it led them, and a member
            # that had not read its declaration yet when it launched (a store takes a second
            # from a home link) led a group of its own: the round split, the newcomer's group
            # waiting out its window for that member (11 s of an 8 s phase in the lab). An
            # open-run newcomer meeting a round ahead (``SwarmPort.behind``) cannot know when the
            # swarm gets there either: whenever it arrives, it finds the newcomer declared.
            newcomer = self.swarm.behind(self.state.round)
            timeout = self._join_timeout(newcomer=newcomer)
            if not newcomer:
                timeout = max(timeout, self._follow_timeout())
            window = matchmaking_window(timeout)
        data = self.task.data_report(inner.data_round) if self.task.data_report is not None and inner.done else None
        lr = inner_lr(self.spec, inner.round, max(0, inner.done - 1))
        flight = _InFlight(
            _NOT_STARTED,
            compensated,
            samples,
            loss,
            compute_s,
            pre_digest,
            prep_started,
            time.monotonic() - prep_started,
            lr,
            data,
            eager,
        )
        flight.start = _Launch(weight, gather, timeout, window, joining=inner.joining or not inner.steps)
        flight.carried, flight.carried_s = carried, carried_s
        flight.writing = writing
        if writing is None:
            self._start_round(flight)
        return flight

    def _host_vector(self) -> torch.Tensor:
        """A flat float32 host vector of the state's size, pinned when the model is on CUDA
        (its transfers run at the link's speed and may be asynchronous)."""
        pin = next(self.model.parameters()).device.type == "cuda"
        return torch.empty(self.state.params.numel(), dtype=torch.float32, pin_memory=pin)

    def _mirrored(self) -> DeviceMirror | None:
        """The device mirror, decided at the first launch (the inner steps' peak memory is
        reserved by then): made when ``options.device_mirror`` says so or the device has room."""
        if not self._mirror_decided:
            self._mirror_decided = True
            device = next(self.model.parameters()).device
            numel = self.state.params.numel()
            validates = bool(self.spec.eval.every_rounds) and self.task.eval_batches is not None
            wanted = self.options.device_mirror
            if wanted is None:
                wanted = room_for(device, 1, numel)
                validates = validates and room_for(device, 2, numel)
            if wanted:
                self._mirror = DeviceMirror(device, numel, validate=validates)
                logger.info(
                    "the launch point%s stays on %s (%.2f GB of its memory)",
                    " and θ_g" if validates else "",
                    device,
                    self._mirror.nbytes / 1e9,
                )
            elif device.type == "cuda":
                logger.info("no room on %s for the launch point: it moves through pinned host memory", device)
        return self._mirror

    def _write_delta(self, mirror: DeviceMirror | None) -> bool:
        """On the landing thread: the launch point from the device mirror (when there is one),
        then the averager's vector ← θ_g − launch point (+ residual)
        (``peer.round.host_passes.write_delta_from``); zeros if that is not finite. Whether it was."""
        assert self._launch_point is not None
        if mirror is not None:
            mirror.download(self._launch_point)
        with self.swarm.outbox() as out:
            finite = write_delta_from(self._launch_point, self.state.params, out, feedback=self.feedback)
            if not finite:
                out.zero_()
        return finite

    def _start_round(self, flight: _InFlight) -> None:
        """Start the launched round's averaging, once its pseudo-gradient is written (waiting
        for the landing thread if need be)."""
        started = time.monotonic()
        if flight.writing is not None:
            finite = flight.writing.result()
            flight.writing = None
            if not finite:  # θ_g, the launch point or the residual: nothing of it can be sent
                self._drop_local_work(f"its pseudo-gradient went non-finite in round {self.state.round}")
                assert self._launch_point is not None
                copy_model_into(self.model, self._launch_point)
                flight.samples, flight.loss, flight.compensated = 0, float("nan"), False
                flight.carried, flight.carried_s = 0, 0.0
                assert flight.start is not None
                flight.start = flight.start.claiming_nothing()
        assert flight.start is not None
        start = flight.start
        flight.pending = self.swarm.start_round(
            weight=start.weight, gather=start.gather, timeout=start.timeout, window=start.window, joining=start.joining
        )
        flight.launched_at = time.monotonic()
        flight.prep_s += flight.launched_at - started

    def matchmaking_timeout(self, compute_s: float) -> float:
        """How long a launched round may look for its group. With overlap, waiting costs nothing
        until this peer's next inner phase ends (about ``compute_s``, the phase just finished),
        so it waits at least that long: peers of unequal speed launch further and further apart
        (each one's rounds start when its own inner phase ends), and a deadline shorter than
        that drift failed whole rounds for every member at once."""
        if self.overlap:
            return max(self.timeouts.matchmaking_s, compute_s)
        return self.timeouts.matchmaking_s

    def _follow_timeout(self) -> float:
        """A search long enough that a join declared now expires after the members it joins:
        their window (by this peer's own deadline) from their launch (``_swarm_launches_at``),
        plus ``FOLLOW_MARGIN_S`` for the differences between their adaptive deadlines and its."""
        launch = self._swarm_launches_at(self.state.round)
        ahead = 0.0 if launch is None else max(0.0, launch - time.monotonic())
        members = matchmaking_window(self.matchmaking_timeout(self._phase_s or 0.0))
        return search_for_window(members + ahead + FOLLOW_MARGIN_S)

    def _join_timeout(self, *, newcomer: bool = False) -> float:
        """How long a round launched at once (``_launch_now``, or an open-run newcomer's) may look
        for its group: the others launch when their phase ends, up to a whole phase later, so
        twice a phase (this peer's last, else the spec's time budget), at least the matchmaking
        deadline. A newcomer meeting a round ahead, with no phase of its own, counts a phase as
        long as the matchmaking deadline: the round it meets may be one whose roster lost a
        member, which lasts its leader's window."""
        unknown = self.timeouts.matchmaking_s if newcomer else 0.0
        phase = self._phase_s or self.spec.rounds.time_budget_s or unknown
        return max(self.timeouts.matchmaking_s, 2 * phase)

    @torch.no_grad()
    def _drop_local_work(self, why: str) -> None:
        """Throw away this peer's local progress: the model goes back to θ_g (the start point)
        and the inner optimizer starts afresh (its moments may hold the same non-finite values)."""
        logger.warning(
            "dropping this peer's local work (%s): reloaded the global parameters, reset the inner "
            "optimizer; it claims no samples for this round",
            why,
        )
        load_flat(self.model, self.state.params)
        self.optimizer = inner_optimizer(self.spec, self.ranks.forward)
        self.ranks.optimizer_rebuilt()
        self._unlanded = (0, 0.0)

    def _finish(self, flight: _InFlight, *, wait: bool) -> bool:
        """Land the round in flight (waiting for its result if need be): apply or undo it, record
        it; True once done. With overlap a successful round's host half runs on the landing
        thread: then, unless ``wait``, False until it is done (the inner steps go on)."""
        if flight.writing is not None:
            self._start_round(flight)
        if flight.landing is None:
            wait_started = time.monotonic()
            if not flight.pending.done():
                self.phase = Phase.AVERAGING
                self.progress.waiting(self.state.round)
                while not flight.pending.wait(LANDED_CHECK_S):
                    self._abandon_if_landed(flight)
            result = flight.result = self._the_rounds_state(flight.pending.result(), flight)
            landed = time.monotonic()
            flight.wait_s = landed - wait_started
            if result is not None:
                logger.info("round %d averaged in a group of %d: landing it", self.state.round, result.group_size)
                if self.journal is not None:
                    self.journal.landing(self._round_metrics(flight, self.state.round + 1), flight.pre_digest)
            self.phase = Phase.APPLYING
            landing = self._apply(flight, result)
            flight.host_s = time.monotonic() - landed
            if not isinstance(landing, Future):
                self._landed_round(flight, digest_known=landing)
                return True
            flight.landing = landing
            if not wait:
                return False
        blocked = time.monotonic()
        if not flight.landing.done():
            self.phase = Phase.APPLYING
        flight.landing.result()  # its errors are the training thread's
        started = time.monotonic()
        flight.wait_s += started - blocked
        digest_known = self._rebase(flight)
        flight.host_s += time.monotonic() - started
        self._landed_round(flight, digest_known=digest_known)
        return True

    def _landed_round(self, flight: _InFlight, *, digest_known: bool) -> None:
        """Record a round that landed (or failed): its metrics, once the new state's digest is known."""
        result = flight.result
        metrics = self._round_metrics(flight, self.state.round)
        checkpoint = result is not None and self.state.round % self.options.checkpoint_every == 0
        kept = (self.state.round - 1, flight.pre_digest, list(result.left_out)) if result and flight.counted else None
        at = time.time() if kept is not None else None
        self._landed = _Landed(metrics, checkpoint, flight.prep_s + flight.host_s, kept, at)
        if digest_known:
            self._record_landed(wait=True)

    def _round_metrics(self, flight: _InFlight, round_: int) -> RoundMetrics:
        """The metrics of the round ``flight`` averaged (or failed), numbered ``round_``, without
        the new state's digest."""
        result = flight.result
        landing_s = flight.landing.result() if flight.landing is not None else 0.0
        return RoundMetrics(
            round=round_,
            group_size=result.group_size if result else 1,
            samples=flight.samples,
            carried=flight.carried,
            carried_s=round(flight.carried_s, 4),
            loss=flight.loss,
            state_digest="",  # filled in by _record_landed
            bytes_sent=result.bytes_sent if result else 0,
            bytes_received=result.bytes_received if result else 0,
            compute_s=round(flight.compute_s, 4),
            wait_s=round(flight.wait_s, 4),
            wall_s=round(flight.compute_s + (time.monotonic() - flight.launched_at), 4),
            # an averaged round's row says whether it counted (it started from its group's state),
            # not what the peer is by the time the row is written: with the landing on its own
            # thread, a peer whose round did not count may re-sync before its row is recorded,
            # and its row then named its own stale landing "in sync" (the churn lab counted it
            # as a second state and as credit lost, which the coordinator had rightly denied)
            in_sync=flight.counted if result is not None else self.in_sync,
            averaged=result is not None,
            members=result.members if result else [],
            offenders=result.offenders if result else {},
            receipts=result.receipts if result else {},
            unaveraged=round(result.unaveraged(), 6) if result else 0.0,
            left_out=round(result.left_out_share(), 6) if result else 0.0,
            failure=flight.failure,
            audit_s=round(result.audit_s, 4) if result else 0.0,
            audit_bytes=result.audit_bytes if result else 0,
            params=self.state.params.numel(),
            allreduce_s=round(result.allreduce_s, 4) if result else 0.0,
            matchmaking_timeout_s=round(self.timeouts.matchmaking_s, 2),
            allreduce_timeout_s=round(self.timeouts.allreduce_s, 2),
            local_world_size=self.ranks.world_size,
            lr=flight.lr,
            data=flight.data,
            launch_s=round(flight.prep_s, 4),
            landing_s=round(landing_s, 4),
        )

    def _record_landed(self, *, wait: bool) -> None:
        """Finish the round that landed last once the new state's digest is known (it is hashed
        on a background thread while the next inner steps run): publish the digest record,
        write the checkpoint, record the metrics. Without ``wait``, only if the digest is ready."""
        landed = self._landed
        if landed is None or (not wait and not self.state.digest_ready()):
            return
        started = time.monotonic()
        digest = self.state.digest()
        if self.publisher.snapshot[:2] != (self.state.round, digest):
            self._publish(landed=landed.at)
        if landed.kept is not None:
            round_, pre, left_out = landed.kept
            self.swarm.keep_update(round_, pre, digest, left_out)
        if landed.checkpoint:
            self.save_checkpoint()
        self._landed = None
        val_loss = self._validation_loss() if landed.metrics.averaged else None
        metrics = dataclasses.replace(
            landed.metrics,
            state_digest=digest,
            val_loss=val_loss,
            host_s=round(landed.host_s + time.monotonic() - started, 4),
            record_s=round(time.monotonic() - started, 4),
            digest_s=round(self.state.digest_s, 4),
            at=round(time.time(), 3),
        )
        self.history.append(metrics)
        self.on_round(metrics)

    @torch.no_grad()
    def _validation_loss(self) -> float | None:
        """The loss of θ_g (the swarm's model after the round just landed) on the run's held-out
        batches, on rounds that are a multiple of ``eval.every_rounds``. The model holds θ_g plus
        this peer's progress since the launch (overlap): it is swapped for θ_g and back."""
        if not self._validates(self.state.round):
            return None
        assert self.task.eval_batches is not None
        if self.ranks.sharded:
            logger.info("no validation loss on a node sharded over its ranks (the leader holds no device copy)")
            return None
        started = time.monotonic()
        mirror = self._mirror
        if mirror is not None and not mirror.holds_theta(self.state.params, self.state.round):
            mirror = None
        local: torch.Tensor | None = None
        if mirror is not None:  # θ_g is on the device already: swap it in there
            mirror.swap_in_theta(self.model)
        else:
            local = flatten(self.model)
            load_flat(self.model, self.state.params)
        self.model.eval()
        total, count = 0.0, 0
        try:
            for inputs, targets in self.task.eval_batches():
                with self.precision.autocast():
                    loss = self.task.loss_fn(self.model, (inputs, targets))
                total += float(loss) * inputs.shape[0]
                count += inputs.shape[0]
        finally:
            self.model.train()
            if mirror is not None:
                mirror.swap_back(self.model)
                mirror.forget_theta()
            else:
                assert local is not None
                load_flat(self.model, local)
        if count == 0:
            return None
        value = total / count
        logger.info(
            "validation loss after round %d: %.4f (%d sequences, %.2f s)",
            self.state.round,
            value,
            count,
            time.monotonic() - started,
        )
        return value

    def _validates(self, round_: int) -> bool:
        """Whether the state of ``round_`` gets a validation loss (``eval.every_rounds``)."""
        every = self.spec.eval.every_rounds
        return bool(every) and self.task.eval_batches is not None and round_ % every == 0

    def _adapt_timeouts(self, result: RoundResult | None) -> None:
        before = self.timeouts.allreduce_s
        if result is None:
            self.timeouts.failed()
        else:
            self.timeouts.observe(matchmaking_s=result.round_s - result.allreduce_s, allreduce_s=result.allreduce_s)
        if abs(self.timeouts.allreduce_s - before) > 0.1 * before:
            self.swarm.set_allreduce_timeout(self.timeouts.allreduce_s)

    @torch.no_grad()
    def _apply(self, flight: _InFlight, result: RoundResult | None) -> bool | Future[float]:
        """Land the round; True unless the new state's digest is being computed in the
        background (a successful round: ``_record_landed`` publishes it). With overlap, a
        successful round's host half goes to the landing thread: its future (``_rebase`` ends
        the landing)."""
        self._adapt_timeouts(result)
        self._uncounted = None
        counted = result is not None and result.started_in_sync(self.state.round, flight.pre_digest)
        flight.counted = counted
        if not counted:  # its work stays in the model (or goes with it onto the state it adopts next)
            samples, seconds = self._unlanded
            self._unlanded = (samples + flight.samples + flight.carried, seconds + flight.compute_s + flight.carried_s)
        if result is None:
            if flight.eager and model_is_finite(self.model):
                assert self._launch_point is not None
                with self._state_lock:
                    undo_eager_start(self.model, self.state, self._launch_point, self._outer(), self._staging)
            self._carry_over = None  # still in the model: the next round's Δ holds it
            # θ_g, the momentum and the codec residual are untouched: the round's work folds into
            # the next round's pseudo-gradient
            if self._swarm_moved_on():
                # others averaged without us: training on from the old state would only make
                # this peer a stale member of its next group (weight 0), so re-sync first
                logger.warning("round %d failed here but the swarm moved on; catching up", self.state.round)
                self.in_sync = False
        else:
            if not counted:
                self.in_sync = False
                logger.warning("this peer started round %d from another state than its group", self.state.round)
                # its group weighed this round's work 0: carry it into the state it adopts next
                launched = self._launch_point if self._launch_point is not None else flatten(self.model)
                self._uncounted = torch.sub(launched, self.state.params)
            else:
                self.roster.landed(result.members)
            self.swarm.saw_group(result.members)
            keep_progress = self.overlap and model_is_finite(self.model)
            outer = self._outer()
            if self.options.host_thread and keep_progress and self._launch_point is not None and not self.ranks.sharded:
                feedback = self.feedback if flight.compensated and counted else None
                return self._landing_thread().submit(
                    self._land_global, result.averaged, outer, feedback, flight.eager, result.left_out
                )
            with self._state_lock:
                land_round(
                    self.model,
                    self.state,
                    result.averaged,
                    outer,
                    feedback=self.feedback if flight.compensated and counted else None,
                    launch_point=self._launch_point,
                    keep_progress=keep_progress,
                    staging=self._staging,
                    eager=flight.eager,
                    codec=self.codec.at_round(self.state.round),
                    missing=result.left_out,
                )
                if self._carry_over is not None and counted:  # held out of this round: back in
                    load_flat(self.model, torch.add(flatten(self.model), self._carry_over))
                self._carry_over = None  # not counted: ``_uncounted`` holds it (from the launch point)
            if self.overlap and not keep_progress:
                self._drop_local_work(f"its model went non-finite while round {self.state.round - 1} averaged")
            return self._landed_state()
        if not self.in_sync:
            self.catch_up()
        return True

    def _landed_state(self) -> bool:
        """After a successful round's landing: hash the new state in the background (False), or,
        out of sync, publish it and re-sync (True)."""
        if self.in_sync:
            self.state.start_digest()
            return False
        self._publish()
        self.catch_up()
        return True

    def _landing_thread(self) -> ThreadPoolExecutor:
        if self._lander is None:
            self._lander = ThreadPoolExecutor(max_workers=1, thread_name_prefix="landing")
        return self._lander

    def _land_global(
        self,
        averaged: torch.Tensor,
        outer: OuterSection,
        feedback: ErrorFeedback | None,
        eager: bool,
        left_out: list[tuple[int, int]],
    ) -> float:
        """The landing's host half (``peer.round.host_passes.land_global``), on the landing thread: the
        model is not touched, the launch point becomes the re-base shift. Its seconds."""
        started = time.monotonic()
        assert self._launch_point is not None
        with self._state_lock:
            land_global(
                self.state,
                averaged,
                outer,
                feedback=feedback,
                launch_point=self._launch_point,
                eager=eager,
                codec=self.codec.at_round(self.state.round),
                missing=left_out,
            )
        if self._mirror is not None:  # (never made for an eager start: ``_launch``)
            self._mirror.upload_shift(self._launch_point)
            if self._validates(self.state.round + 1):
                self._mirror.stage_theta(self.state.params, self.state.round + 1)
        return time.monotonic() - started

    @torch.no_grad()
    def _rebase(self, flight: _InFlight) -> bool:
        """The landing's last part, between two inner steps: θ_local += the shift the landing
        thread left in the launch point; the round advances. As ``_apply``'s return."""
        assert self._launch_point is not None
        if self._mirror is not None:
            self._mirror.rebase(self.model)
        else:
            rebase_model(self.model, self._launch_point)
        with self._state_lock:
            self.state.round += 1
        if self._carry_over is not None and flight.counted:  # held out of this round: back in
            load_flat(self.model, torch.add(flatten(self.model), self._carry_over))
        self._carry_over = None  # not counted: ``_uncounted`` holds it (from the launch point)
        return self._landed_state()

    def _outer(self) -> OuterSection:
        """The outer step's settings for the current round (the same lr in every member)."""
        return outer_at(self.spec, self.state.round)

    def _the_rounds_state(self, result: RoundResult | None, flight: _InFlight) -> RoundResult | None:
        """``result`` if it is the round's one state here (``RoundVerdict.judge``), else None with
        the reason in ``flight.failure``."""
        gathered = flight.start.gather.round if flight.start is not None else None
        judged = self.verdict.judge(result, self.state.round, flight.pre_digest, gathered)
        if judged.failure:
            flight.failure = judged.failure
        return judged.lands

    def _abandon_if_landed(self, flight: _InFlight) -> None:
        """Give up the round in flight if it is still looking for its group and the swarm has
        landed the round it meets at: its group formed without this peer (a peer that adopted a
        state while the swarm moved on, one that launched late), and its window, two phases
        long, would pass at a key nobody comes to any more. The round then fails here as any
        failed round does: this peer re-syncs and keeps its local work. At most every
        ``LANDED_CHECK_S`` (it reads the DHT's digest records)."""
        now = time.monotonic()
        if now < self._landed_check_at or flight.pending.done():
            return
        self._landed_check_at = now + LANDED_CHECK_S
        agreed = self.swarm.accepted_state(exclude=self.identity.public_key)
        if agreed is not None and agreed.round > flight.pending.meets and flight.pending.abandon():
            logger.warning(
                "the swarm landed round %d without this peer (its state is of round %d): giving up the search",
                flight.pending.meets,
                agreed.round,
            )

    def _swarm_moved_on(self) -> bool:
        """Whether the DHT already shows a later agreed round than this peer's (best effort:
        the others may not have published yet; then the next group spots it)."""
        agreed = self.swarm.accepted_state(exclude=self.identity.public_key)
        return agreed is not None and agreed.round > self.state.round

    def _publish(self, *, landed: float | None = None) -> None:
        """Publish the digest record of this peer's state (``landed``: when it landed the state
        by averaging, wall clock; None when it adopted it)."""
        self.publisher.publish(self.state.round, self.state.digest(), landed)

    def _say_leaving(self) -> None:
        """A clean stop: the record of the state it holds says it leaves (not when out of sync)."""
        if self.in_sync:
            self.publisher.say_leaving()

    def _serve(self) -> tuple[int, torch.Tensor, torch.Tensor, str]:
        """The state to hand a peer that downloads it: a copy taken between two in-place
        changes (serving is rare; a torn state would only fail the downloader's digest check)."""
        with self._state_lock:
            state = self.state
            return state.round, state.params.clone(), state.momentum.clone(), state.digest()

    def wait_for_group(self) -> bool:
        """Wait (up to ``options.wait_for_group_s``) until ``min_group_size`` peers, this one
        included, published a digest for this peer's round. True if they did."""
        return self.resync.wait_for_group(self.state.round, self.options.wait_for_group_s)

    def catch_up(self) -> bool:
        """Adopt the swarm's latest state if ours is not it (``Resync.catch_up``). True if we
        hold the swarm's state."""
        self.phase = Phase.RESYNCING
        found = self.resync.catch_up(self.state, self.in_sync)
        if found.ended is not None:
            self.missed_end = found.ended
            return False
        if found.adopt is not None:
            self._adopt(found.adopt.state, accepted=set(found.accepted), through=found.adopt.through)
            return True
        if found.held:
            self.in_sync = True
            self._publish()
        return found.held

    @torch.no_grad()
    def _adopt(self, state: GlobalState, *, accepted: set[str], through: tuple[tuple[int, str], ...] = ()) -> None:
        """Make ``state`` this peer's; its digest must be in ``accepted`` (agreed by the swarm);
        ``through``: the states a roll forward passed on the way (``Rolled.through``)."""
        if state.digest() not in accepted:  # the averager checked; check again where it is used
            raise VerificationError("downloaded state does not match the swarm's digest")
        round_ = state.round
        self.roster.adopted(
            self.swarm.roster_of(state.digest(), exclude=self.identity.public_key),
            round_=round_,
            me=self.identity.public_key.id,
        )
        carried: torch.Tensor | None = None
        if self.roster.known:  # its own group made this state without it: its work is averaged in
            self._drop_averaged_work(round_)
        else:
            carried = self._work_to_carry(round_)
        with self._state_lock:
            self.state = state
        if self._mirror is not None:
            self._mirror.forget_theta()
        load_flat(self.model, state.params if carried is None else torch.add(state.params, carried))
        self.in_sync = True
        if self.journal is not None:
            # the states a roll forward passed through are the swarm's too (each update's result
            # checked, the last against the records): a report left unfinished for one of them
            # goes with its digest
            self._finish_reports(round_, passed={passed for passed, _ in through})
            for passed, digest in through:
                if passed < round_:
                    self.journal.holds(passed, digest)
            self.journal.holds(round_, state.digest())
        self._launch_now, self._carry_over = True, carried
        logger.info(
            "adopted the swarm's state of round %d (%s), digest verified%s",
            round_,
            state.digest()[:19],
            "; this peer's uncounted local work carried over" if carried is not None else "",
        )
        self._publish()

    def _finish_reports(self, held_round: int, *, passed: set[int]) -> None:
        """Reports a previous run of this peer left unfinished (killed while it landed their
        rounds) for rounds before ``held_round`` that it did not pass through: it never held
        their states, so it asks a member for each round's update, which names the state the
        round made (``FetchedUpdate.post``), and finishes the report with that digest. A server
        that lies costs only that report's credit (the coordinator grants a claim only with the
        digest its group's reports name); none kept it: the report goes (``journal.holds``)."""
        assert self.journal is not None
        timeout = self.spec.averaging.allreduce_timeout_s
        for round_, pre in self.journal.unfinished():
            if round_ >= held_round or round_ in passed or not pre:
                continue
            update = self.swarm.download_update(round_ - 1, pre, timeout=timeout)
            if update is not None and (update.round, update.pre) == (round_ - 1, pre) and update.post:
                logger.info("round %d's update names the state its group made: finishing its report", round_)
                self.journal.holds(round_, update.post)

    def _drop_averaged_work(self, adopted_round: int) -> None:
        """The state adopted is the one this peer's own group made while a reducer failed it
        (``RosterBook.missed``): the group averaged this peer's parts in (its reporters name it,
        and the coordinator credits it for that round in absentia), so carrying the same work
        onto that state would weigh and claim it twice. Dropped; what the failed reducer's range
        lacked of it is lost, a sliver of one round."""
        self._uncounted = None
        if self._unlanded != (0, 0.0):
            logger.info(
                "round %d's state holds this peer's work (its group averaged it in): not carrying it again",
                adopted_round - 1,
            )
        self._unlanded = (0, 0.0)

    def _work_to_carry(self, adopted_round: int) -> torch.Tensor | None:
        """The local work the swarm has not counted yet (progress since this peer's start point,
        plus a round its group weighed 0), to re-base onto an adopted state so that it enters
        the next round's pseudo-gradient instead of being thrown away, like the work of a failed
        round. Dropped when it is more than ``MAX_CARRIED_ROUNDS`` rounds stale or not finite."""
        work = torch.sub(flatten(self.model), self.state.params)
        if self._uncounted is not None:
            work.add_(self._uncounted)
            self._uncounted = None
        if not bool(work.any()):
            self._unlanded = (0, 0.0)
            return None
        if adopted_round - self.state.round > MAX_CARRIED_ROUNDS or not bool(torch.isfinite(work).all()):
            logger.info(
                "dropping this peer's local work: %d rounds stale or not finite", adopted_round - self.state.round
            )
            self._unlanded = (0, 0.0)
            return None
        return work
