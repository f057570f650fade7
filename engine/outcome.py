"""What one averaging step gives its caller (``ExactAverager.step``): what each member of the
group stated, and what this peer's all-reduce did (or why it failed once begun). It crosses from the averager's process to
the peer's, so it is plain picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.gathered import Gathered

__all__ = ["AllReduceStats", "FragmentDone", "GroupOutcome"]


@dataclass
class AllReduceStats:
    """This peer's side of one group's all-reduce, over every fragment."""

    bytes_sent: int = 0
    bytes_received: int = 0
    refused_senders: dict[str, str] = field(default_factory=dict)
    """Members (libp2p id) whose parts this peer's reducer refused, with why."""
    offences: dict[str, str] = field(default_factory=dict)
    """Members (libp2p id) whose contribution this peer's reducer bounded or refused, or whose
    reducer failed this peer, with why."""
    allreduce_s: float = 0.0
    peer_ids: list[str] = field(default_factory=list)
    """The group's members (libp2p ids) in the all-reduce's order."""
    streams: int = 0
    """All-reduce runners (fragments) the group averaged over."""
    missing: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` ranges of the vector that hold no average (their reducer failed)."""
    left_out: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` ranges of reducers this peer's audits caught returning a wrong average
    (``engine.audit``): they land as if their reducer had failed, and the round still lands."""
    audit_s: float = 0.0
    """Seconds of this peer's audits after the all-reduce (``engine.auditing``)."""
    audit_bytes: int = 0
    """Bytes this peer's audits fetched from other members."""
    receipts: dict[str, bytes] = field(default_factory=dict)
    """Each reducer (libp2p id) → its signed receipt for this peer's parts (``protocol.receipts``)."""
    start_bytes: int = 0
    """Bytes this peer sent to start the group (``engine.start_tree``): a leader's start
    messages, and the group served to the members that fetched it here."""
    over_bulk: list[str] = field(default_factory=list)
    """Reducers (libp2p id) this peer's parts went to over the bulk channel in every fragment
    (``engine.bulk_channel``); the others' went over libp2p, in one fragment at least."""


@dataclass(frozen=True)
class GroupOutcome:
    """A step that completed: the group's statements and this peer's all-reduce."""

    gathered: dict[str, Gathered | None]
    """Each member (libp2p id) → what it stated (None: nothing readable)."""
    stats: AllReduceStats
    led: dict[str, float] | None = None
    """Set if this peer led the group (``engine.matchmaking.RoundMatchmaking.led``)."""
    failed: str = ""
    """Why this peer's all-reduce failed once begun ("" if it completed): nothing of the vector
    is averaged here (``stats.missing`` is all of it); the others may land the round without
    this peer."""


@dataclass
class FragmentDone:
    """What the host learns when fragment ``index`` of a round is averaged (or is not)."""

    index: int
    start: int
    """Where the fragment starts in the whole vector; its values are the buffer's first ``end - start``."""
    end: int
    missing: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` ranges of the whole vector, inside this fragment, that hold no average:
    reducers that failed, or whose average an audit caught (the same in every member that saw it)."""
    failed: str = ""
    """Why the fragment was not averaged here ("" if it was): the buffer holds nothing of use."""
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_s: float = 0.0
    """From the gate's open to its answer, as the averager saw it."""
    members: dict[str, Gathered | None] | None = None
    """The first fragment's answer: what each member of the group stated (libp2p id → its
    statement; None: unreadable), so that the host judges the round before it lands anything."""

    @property
    def averaged(self) -> bool:
        return not self.failed
