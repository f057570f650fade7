"""The knobs of one peer's trainer that are not part of the run spec (``TrainerOptions``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from peer.node.node import LocalNode
from protocol.identity import Identity


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
