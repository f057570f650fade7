"""What the parts of a peer's round share (``peer.round.trainer``): ``Crew``, the services they
call (the swarm, the codec, the roster book, the timeouts, the digest publisher), and
``LocalState``, the one record of this peer's own model, state and owed work, which the parts
change and nothing else holds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.checkpoint import Checkpointer
from engine.compression import Codec, ErrorFeedback
from peer.node.inner_step import Precision
from peer.node.local_ranks import LocalRanks
from peer.round.device_mirror import DeviceMirror
from peer.round.host_passes import Staging
from peer.round.options import TrainerOptions
from peer.round.progress import ProgressSink
from peer.round.publisher import DigestPublisher
from peer.round.resync import Resync
from peer.round.roster_book import RosterBook
from peer.round.round_metrics import RoundJournal, RoundMetrics
from peer.round.state import GlobalState
from peer.round.swarm_port import SwarmPort
from peer.round.timeouts import AdaptiveTimeouts
from peer.round.verdict import RoundVerdict
from peer.task import Task
from protocol.identity import Identity
from protocol.spec import RunSpec


class LandingThread:
    """The one thread beside training (overlap): it writes a launch's pseudo-gradient and runs a
    landing's host half while the inner steps go on. Started at its first task."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="landing")
        return self._pool.submit(work, *args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class Crew:
    """The services a round's parts call, made once per trainer. ``codec``, ``feedback``,
    ``timeouts``, ``checkpointer`` and ``on_round`` may be replaced (benchmarks, tests): the parts
    read them here each time."""

    spec: RunSpec
    task: Task
    swarm: SwarmPort
    options: TrainerOptions
    identity: Identity
    codec: Codec
    feedback: ErrorFeedback | None
    ranks: LocalRanks
    precision: Precision
    staging: Staging
    roster: RosterBook
    """The roster of the state this peer holds (``protocol.roster``): gathered each round."""
    verdict: RoundVerdict
    """Whether each round's result is the round's one state here (``peer.round.verdict``)."""
    resync: Resync
    """Finds the swarm's state (``peer.round.resync``); its ``link``, the bytes a second this
    peer's link carries (its last state download, waits included: a low estimate), is stated to
    its groups (``Gathered.link``), which stretch a round's deadlines to their slowest member's
    (``engine.link_timeouts``)."""
    timeouts: AdaptiveTimeouts
    publisher: DigestPublisher
    """This peer's digest record (``peer.round.publisher``)."""
    checkpointer: Checkpointer | None
    journal: RoundJournal | None
    """Told when a round begins to land and which state this peer holds (the reports)."""
    progress: ProgressSink
    on_round: Callable[[RoundMetrics], None]
    lander: LandingThread = field(default_factory=LandingThread)

    @property
    def overlap(self) -> bool:
        """Whether the next round's inner steps run while a round averages."""
        return self.spec.averaging.overlap if self.options.overlap is None else self.options.overlap

    @property
    def eager(self) -> bool:
        """With overlap, the next inner phase starts at θ̂, not at the launch point."""
        return self.overlap and self.spec.averaging.overlap_start == "eager"


@dataclass
class LocalState:
    """This peer's own model and state and the work it owes the swarm, shared by the round's
    parts (each field's owner says when it changes: ``peer.round.trainer``)."""

    model: torch.nn.Module
    """Sharded over local ranks, the leader's plain full copy (host memory), and the ranks train
    FSDP2 shards of it on their devices (``peer.node.node``)."""
    state: GlobalState
    """θ_g, the outer momentum and the round, changed in place under ``state_lock``."""
    optimizer: torch.optim.Optimizer
    launch_point: torch.Tensor | None
    """With overlap, θ_local at the launch of the round in flight (training moves on meanwhile)."""
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the state changes in place or is copied for serving."""
    mirror: DeviceMirror | None = None
    """With overlap, the launch point (and θ_g) on the model's device, where it has room (made at
    the first launch: ``Launcher.mirrored``)."""
    mirror_decided: bool = False
    in_sync: bool = True
    missed_end: int | None = None
    """The run's final round, when the swarm landed it without this peer and nobody serves its
    state any more: the run is over for this peer too (``Adoption.catch_up``)."""
    launch_now: bool = False
    """Set when this peer adopted a downloaded state: its next round launches at once (no
    samples) so that it is in the swarm's next group and so in its roster; the others launch
    when their phase ends, and a roster that is complete does not wait for a late peer outside it."""
    carry_over: torch.Tensor | None = None
    """Local work carried onto an adopted state, held out of the round launched at once (it
    sends nothing) and added back to the model once that round lands."""
    phase_s: float | None = None
    """How long this peer's last inner phase that trained took (the join round's deadline)."""
    uncounted: torch.Tensor | None = None
    """Work of a round that this peer's group weighed 0 (it started from a stale state)."""
    unlanded: tuple[int, float] = (0, 0.0)
    """Samples (and their inner steps' seconds) of rounds that did not land here, whose work is
    still in the model (or carried onto an adopted state): the next round that sends it weighs
    and claims them too, since its pseudo-gradient holds them."""
    between_rounds: bool = False
    """Fragments in turn: some of the round in flight has landed on the state and some not; it
    is nobody's state until the last lands (``peer.round.in_turn``), and is served to nobody."""
    inner_steps_done: int = 0
    data_round: int = -1
    """The last data round an inner phase read (``InnerPhase.data_round``); checkpointed."""
    history: list[RoundMetrics] = field(default_factory=list)
    resumed_landed: float | None = None
    """When this peer landed the state its checkpoint holds (None: adopted, or no checkpoint)."""

    def host_vector(self) -> torch.Tensor:
        """A flat float32 host vector of the state's size, pinned when the model is on CUDA (its
        transfers run at the link's speed and may be asynchronous)."""
        pin = next(self.model.parameters()).device.type == "cuda"
        return torch.empty(self.state.params.numel(), dtype=torch.float32, pin_memory=pin)
