"""What the store's queries return: typed, immutable rows (a snapshot of what was
committed when the query ran; changing one changes nothing stored)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.store.schema import PENDING

__all__ = [
    "BanRow",
    "ClaimRow",
    "CreditTotals",
    "LeaderRow",
    "PeerCredit",
    "PeerRow",
    "RoundRow",
    "RoundTiming",
    "RunRow",
    "SwarmPoint",
]


@dataclass(frozen=True)
class ClaimRow:
    """One peer's claim for one round (``claims`` table)."""

    key: str
    round: int
    samples: int
    group_json: str
    """The reporter's group as it reported it: ``[[key, weight(, offence)], ...]``."""
    state_digest: str
    duration_s: float
    received_at: float
    status: str
    """``pending``, ``granted`` or ``denied``."""
    granted_samples: int
    flops: float
    reason: str
    decided_at: float | None


@dataclass(frozen=True)
class RoundTiming:
    """How a round's time went and what it sent, as its granted reporters said: each figure
    the lower median of theirs (None: nobody said)."""

    compute_s: float | None = None
    """Inner steps."""
    matchmaking_s: float | None = None
    """The wait for the group, less the all-reduce (0 when the round landed during the next
    round's inner steps)."""
    allreduce_s: float | None = None
    landing_s: float | None = None
    """Host work on the training thread: preparing the launch and landing the result."""
    bytes_sent: float | None = None
    bytes_received: float | None = None


@dataclass(frozen=True)
class RoundRow:
    """One finalized round (``rounds`` table)."""

    round: int
    state_digest: str
    """The digest a strict majority of the round's granted reporters hold ("" on a tie)."""
    finalized_at: float
    group_size: int
    """Claims of the round."""
    mean_loss: float | None
    samples: int
    """Granted samples."""
    validation_loss: float | None
    states: int | None = None
    """Distinct state digests its granted reporters landed (more than 1: the round split;
    None: recorded before this was kept)."""
    compute_s: float | None = None
    matchmaking_s: float | None = None
    allreduce_s: float | None = None
    landing_s: float | None = None
    bytes_sent: float | None = None
    bytes_received: float | None = None


@dataclass(frozen=True)
class CreditTotals:
    """A peer's granted credit over every round."""

    samples: int
    flops: float
    rounds: int


@dataclass(frozen=True)
class PeerCredit:
    """A peer's credit as its heartbeat answers it: granted, and claimed but not decided yet."""

    samples: int
    flops: float
    pending_samples: int


@dataclass(frozen=True)
class PeerRow:
    """A peer the coordinator admitted once (``peers`` table)."""

    key: str
    account_key: str | None
    """The account it earns for (None: its own key)."""
    libp2p_peer_id: str
    software_version: str
    hardware_json: str
    reachable: bool
    first_seen: float
    last_seen: float


@dataclass(frozen=True)
class RunRow:
    """The run this database belongs to (``run`` table, one row)."""

    spec_digest: str
    spec_toml: str
    name: str


@dataclass(frozen=True)
class BanRow:
    """A banned peer or account key."""

    key: str
    reason: str
    banned_at: float


@dataclass(frozen=True)
class LeaderRow:
    """One account's granted credit (a peer without an account counts as its own)."""

    account_key: str
    samples: int
    flops: float
    peers: int


@dataclass(frozen=True)
class SwarmPoint:
    """One point of the swarm's time series (one a tick)."""

    at: float
    peers_online: int
    samples_per_second: float
    rounds_failed: int = 0
    """Rounds whose averaging failed, summed over the swarm's peers since the coordinator started."""


@dataclass(frozen=True)
class NewClaim:
    """A pending claim to record (``Store.record_claims``)."""

    key: str
    round: int
    samples: int
    group_json: str
    state_digest: str
    duration_s: float
    received_at: float

    def row(self) -> dict[str, object]:
        """Its row in the claims table, pending."""
        return {
            "key": self.key,
            "round": self.round,
            "samples": self.samples,
            "group_json": self.group_json,
            "state_digest": self.state_digest,
            "duration_s": self.duration_s,
            "received_at": self.received_at,
            "status": PENDING,
            "granted_samples": 0,
            "flops": 0.0,
            "reason": "",
            "decided_at": None,
        }
