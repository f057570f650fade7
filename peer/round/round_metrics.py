"""What a peer records about each round it completed (the ``--metrics-file`` row, the
progress line, the round report to the coordinator)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from peer.task.data_assignment import DataRead
from protocol.gathered import Gathered


@dataclass(frozen=True)
class RoundMetrics:
    """One completed round of one peer. ``as_dict`` is its JSON form (the metrics file's keys)."""

    round: int
    """The global round this peer's state is at after the round (failed rounds do not advance it)."""
    group_size: int
    """Members of the averaging group (1 when the round failed)."""
    samples: int
    """Samples this peer trained on in this round's inner phase (0 when it dropped its work)."""
    loss: float
    """Mean training loss of the round's inner steps."""
    state_digest: str
    """Digest of this peer's global state after the round."""
    bytes_sent: int
    bytes_received: int
    compute_s: float
    """Seconds of inner steps."""
    wait_s: float
    """Seconds the trainer waited for the average (0 when it landed during inner steps)."""
    wall_s: float
    """Seconds from the round's first inner step to its result."""
    in_sync: bool
    """Whether this peer holds the swarm's state after the round."""
    averaged: bool
    """False for a failed round (no group, timeout, missing part)."""
    params: int
    allreduce_s: float
    matchmaking_timeout_s: float
    allreduce_timeout_s: float
    matchmaking_s: float = 0.0
    """Seconds from the round's launch to its group formed: the search, waiting for slower
    peers included (0 when the round failed)."""
    carried: int = 0
    """Samples of earlier rounds that did not land here (their rows' ``samples``), whose work
    this round's pseudo-gradient held: averaged and claimed with this round's (``claimed``)."""
    carried_s: float = 0.0
    """Those rounds' seconds of inner steps."""
    host_s: float = 0.0
    """Host time of the round on the training thread, outside inner steps and the wait for the
    group: preparing the launch (pseudo-gradient and codec residual written into the
    averager's vector) and landing it (residual, outer step, re-basing, publishing the digest,
    checkpoint)."""
    digest_s: float = 0.0
    """Seconds hashing the new state took, on a background thread while the next inner steps
    ran (not in ``host_s``)."""
    launch_s: float = 0.0
    """Of ``host_s``: preparing the launch (the model read, the pseudo-gradient and the codec
    residual written into the averager's vector)."""
    record_s: float = 0.0
    """Of ``host_s``: recording the landed round (validation loss, publishing the digest, the
    checkpoint)."""
    landing_s: float = 0.0
    """With overlap: seconds the landing's host half (residual, outer step, the re-base shift)
    took on the landing thread while the next inner steps ran (not in ``host_s``; 0 when the
    round landed on the training thread)."""
    local_world_size: int = 1
    """Local ranks (GPUs) of this node that trained the round (``peer.node.node``)."""
    members: list[Gathered] = field(default_factory=list)
    """What each group member stated (``protocol.gathered``): id, round, digest, samples, roster."""
    offenders: dict[str, str] = field(default_factory=dict)
    """Members (public id) whose contribution this peer's reducer bounded (robust averaging:
    a capped weight, a clipped part) or refused, with why; reported to the coordinator."""
    receipts: dict[str, bytes] = field(default_factory=dict)
    """Members (public id) → the receipt each one's reducer signed for this peer's parts
    (``protocol.receipts``), reported to the coordinator; not in the metrics row."""

    unaveraged: float = 0.0
    """Fraction of the state the group could not average this round (a member's reducer
    failed): this peer's work there carries into the next round."""
    left_out: float = 0.0
    """Fraction of the state left out of a round that landed: the ranges of reducers this
    peer's audits caught returning a wrong average (``engine.audit``)."""
    audit_s: float = 0.0
    """Seconds this peer's audits took after the all-reduce (in ``allreduce_s``)."""
    failure: str = ""
    """Why the round did not land here ("" if it did): no group formed, a reducer failed, its
    group was not the round's (``peer.round.watchdog`` reads it)."""
    audit_bytes: int = 0
    """Bytes this peer's audits fetched from other members (not in ``bytes_received``)."""

    lr: float = 0.0
    """The inner learning rate of the round's last step (``peer.node.schedule``)."""
    val_loss: float | None = None
    """Validation loss of the state after the round (θ_g) on the run's held-out batches, on
    rounds that are a multiple of ``eval.every_rounds``; None otherwise."""
    data: DataRead | None = None
    """Token runs: what the round's inner steps read (``peer.task.data_assignment``)."""
    at: float = 0.0
    """Unix time the row was recorded (the round landed or failed here): for a run's timeline
    (a join's time to first contribution, goodput over time)."""

    @property
    def claimed(self) -> tuple[int, float]:
        """The samples this round's report claims and the inner steps' seconds they took: the
        round's own, plus those of earlier rounds that did not land here but whose work it
        averaged (``carried``), except in a token run, whose report vouches for one data read
        (the coordinator checks a claim against it: ``coordinator.rounds``): there the round's
        own only (the carried ones weigh in the average all the same)."""
        if self.data is not None:
            return self.samples, self.compute_s
        return self.samples + self.carried, self.compute_s + self.carried_s

    def as_dict(self) -> dict[str, Any]:
        """The metrics file's row (JSON-ready: the members and data as maps; no receipts)."""
        row = dataclasses.asdict(self)
        del row["receipts"]
        return row


class RoundJournal(Protocol):
    """Where the trainer says what a report of a round needs beyond its metrics
    (``peer.link.coordinator_link.CoordinatorLink``): that a round begins to land, and which state
    this peer holds."""

    def landing(self, metrics: RoundMetrics, pre: str) -> None:
        """The round averaged and its landing begins (``metrics`` without the state's digest;
        ``pre``: the digest of the state it started from)."""

    def unfinished(self) -> list[tuple[int, str]]:
        """Rounds whose landing a previous run of this peer did not finish (with the digest each
        started from), oldest first."""

    def holds(self, round_: int, digest: str) -> None:
        """This peer holds the state of ``round_`` with ``digest`` (resumed, or adopted verified)."""
