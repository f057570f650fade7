"""What a claim is and what was decided about it: one peer's word about one round
(``RoundClaim``, made from its verified report by ``coordinator.rounds.RoundBook.claim_of``) and
the ledger's verdict on it (``ClaimVerdict``), as the ledger decides them and the store keeps
them; ``group_json`` and ``claim_from_row`` are the one place a claim goes to the store's row and
back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum

from coordinator.store.rows import ClaimRow

__all__ = ["ClaimStatus", "ClaimVerdict", "GroupMemberView", "RoundClaim", "Voucher", "claim_from_row", "group_json"]


@dataclass(frozen=True)
class Voucher:
    """A member's signed receipt for the reporter's parts (``protocol.receipts``), verified when
    the report came: that member's word on the reporter's weight, given during the all-reduce,
    which stands for its report should that never come (rule 3)."""

    weight: float
    offence: str = ""


@dataclass(frozen=True)
class GroupMemberView:
    """One member of the reporter's averaging group, as the reporter saw it."""

    key: str
    """The member's public id."""
    weight: float
    """Samples that member contributed to the group's average."""
    offence: str = ""
    """Why the reporter's reducer bounded or refused that member's contribution this round
    (robust averaging, ``engine.robust``), or "" if it did not."""
    voucher: Voucher | None = None
    """That member's receipt for the reporter's parts, if the report carried a valid one."""


@dataclass(frozen=True)
class RoundClaim:
    """What one peer says about one round: its samples and its averaging group."""

    key: str
    round: int
    samples: int
    """Samples the reporter says it processed this round."""
    group: tuple[GroupMemberView, ...]
    """The reporter's averaging group, the reporter included."""
    state_digest: str
    """Digest of the global parameters the reporter holds after the round."""
    duration_s: float
    """The reporter's wall time for the round, seconds, > 0."""
    received_at: float
    """When the coordinator received the claim (coordinator clock, seconds)."""
    account: str = ""
    """The account the reporter earns for ("" for its own key): members of one account never
    attest each other, and several members of one account attest as one."""
    owner_since: float = -math.inf
    """When the coordinator first saw the reporter's account (its earliest key), coordinator
    clock: with ``min_attester_age_s`` a younger account attests nothing."""

    @property
    def owner(self) -> str:
        """The reporter's account, or its key when it has none."""
        return self.account or self.key

    def weight_for(self, key: str) -> float | None:
        """The weight this claim's group lists for ``key``, or None if it is not listed."""
        return next((m.weight for m in self.group if m.key == key), None)

    def offence_for(self, key: str) -> str:
        """Why this claim's reporter bounded ``key``'s contribution ("" if it did not)."""
        return next((m.offence for m in self.group if m.key == key), "")


class ClaimStatus(str, Enum):
    """Where a claim stands (the ``claims`` table's ``status``)."""

    PENDING = "pending"
    GRANTED = "granted"
    DENIED = "denied"


@dataclass(frozen=True)
class ClaimVerdict:
    """The verdict on one claim, from the ledger's rule (``coordinator.credits``) to the store's
    row and the credits a heartbeat shows: the one verdict type. ``granted_samples`` is 0
    unless GRANTED."""

    key: str
    round: int
    status: ClaimStatus
    granted_samples: int
    reason: str
    claimed_samples: int = 0
    """What the claim said (no longer pending once decided)."""
    in_absentia: RoundClaim | None = None
    """For a member credited without a report of its own (``decide_absent``): the claim its
    witnesses make for it, which the store records with the decision (a claim already
    recorded for the key and round is decided instead)."""
    flops: float = 0.0
    """What the granted samples are worth (the run's FLOPs a sample: ``RoundBook.decide``)."""

    @property
    def granted(self) -> bool:
        return self.status is ClaimStatus.GRANTED


def group_json(claim: RoundClaim) -> str:
    """The group as the store keeps it: ``[key, weight]``, ``[key, weight, offence]`` or, with a
    voucher, ``[key, weight, offence, [voucher weight, voucher offence]]``."""
    rows: list[list[object]] = []
    for m in claim.group:
        row: list[object] = [m.key, m.weight]
        if m.offence or m.voucher is not None:
            row.append(m.offence)
        if m.voucher is not None:
            row.append([m.voucher.weight, m.voucher.offence])
        rows.append(row)
    return json.dumps(rows)


def claim_from_row(row: ClaimRow) -> RoundClaim:
    """The claim a stored row holds (``group_json``'s inverse)."""
    group = tuple(
        GroupMemberView(
            key=entry[0],
            weight=entry[1],
            offence=entry[2] if len(entry) > 2 else "",
            voucher=Voucher(weight=entry[3][0], offence=entry[3][1]) if len(entry) > 3 else None,
        )
        for entry in json.loads(row.group_json)
    )
    return RoundClaim(
        key=row.key,
        round=row.round,
        samples=row.samples,
        group=group,
        state_digest=row.state_digest,
        duration_s=row.duration_s,
        received_at=row.received_at,
    )
