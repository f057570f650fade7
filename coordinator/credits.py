"""Credits: verify what peers claim about their rounds, never trusting a peer about itself.

Pure and clock-free: ``RoundLedger.add`` collects claims, ``RoundLedger.tick(now)`` decides
them. Every decision carries a reason a person can read. Claims come from remote peers, so
malformed ones are rejected with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.store.claims import ClaimStatus, ClaimVerdict, GroupMemberView, RoundClaim, Voucher
from protocol.agreement import Vote, agreed_state
from protocol.messages import MAX_OFFENCE_CHARS

logger = logging.getLogger(__name__)

OFFENCE = "robust averaging"
"""Words in the reason of every claim denied because the group's robust averaging bounded the
member (``Store.denials_by_peer`` counts them: a peer's offences)."""
MAX_FORGOTTEN = 100_000
"""Forgotten rounds the ledger remembers, to refuse late claims for them (a few MB)."""
MIN_ABSENT_WITNESSES = 2
"""Accounts that must attest a member whose own report never came before it is credited in
absentia: one member's say-so credits nobody it names."""


MemberOf = Callable[[str, int], tuple[str, float] | None]
"""``member_of(key, round)``: the account ``key`` earns for and when that account was first seen,
or None for a key the run never admitted, has revoked, or that already has a claim for the round
(one decided before a restart, say) (``RoundLedger.tick``)."""


@dataclass
class _Round:
    claims: dict[str, RoundClaim] = field(default_factory=dict)
    naming: dict[str, list[RoundClaim]] = field(default_factory=dict)
    """Member key -> the round's claims whose group lists it, in arrival order: a claim's
    views, looked up instead of scanned (every claim of the round against every other was
    O(N²) per round: 10,000 reporters kept the core's lock for minutes)."""
    decided: set[str] = field(default_factory=set)
    first_received: float = math.inf
    absent: dict[str, RoundClaim] = field(default_factory=dict)
    """Members credited in absentia: what their witnesses claim for them. Never a witness
    themselves, and a later report of theirs is a second claim."""

    def add(self, claim: RoundClaim) -> None:
        self.claims[claim.key] = claim
        for member in claim.group:  # each key once (``_check_claim``)
            self.naming.setdefault(member.key, []).append(claim)
        self.first_received = min(self.first_received, claim.received_at)

    def views(self, key: str) -> list[RoundClaim]:
        """The round's claims whose group lists ``key``, in arrival order."""
        return self.naming.get(key, [])

    def pending(self) -> list[str]:
        return sorted(k for k in self.claims if k not in self.decided)

    def unreported(self) -> list[str]:
        """Members some claim names that neither reported nor were credited in absentia."""
        return sorted(self.naming.keys() - self.claims.keys() - self.absent.keys())

    def complete(self) -> bool:
        return not self.unreported()


class RoundLedger:
    """Collects round claims and decides each exactly once.

    A round is decided by ``tick(now)`` once it is complete (every member named in any of
    its claims' groups has reported) or ``finalize_after_s`` after its first claim was
    received, with whatever claims are there. A claim arriving after its round was decided
    is decided on the next tick against all of the round's claims. Decided rounds are kept
    ``retain_s`` after their first claim, then forgotten; claims for a forgotten round are
    rejected (the last ``MAX_FORGOTTEN`` such rounds are remembered). Rounds are never
    closed by their number: a claim for round 2**31 - 1 (decided and forgotten like any other)
    must not close the rounds the swarm is still at.

    Rules for a claim ``c`` of round ``r`` (checked in this order):
    1. ``c``'s group lists only ``c`` itself: DENIED, "averaged with nobody".
    2. The group's digest is the digest reported by a strict majority of the round's claims
       whose group lists ``c.key`` (``c`` included). No strict majority: DENIED. ``c``'s
       digest differs from it: DENIED, "digest differs from the group's".
    3. Attesters are the other reporters of round ``r`` whose group lists ``c.key`` (with a
       weight), whose own digest is the group's (a member out of consensus is no witness) and
       whose account is not ``c``'s; several of one account count once (the one with the
       smallest key). One account's nodes vouching for each other is no evidence: keys are
       free to mint, accounts are what an operator allows or bans. With
       ``min_attester_age_s``, an attester whose account the coordinator first saw less than
       that long before its report is no witness either (open runs: fresh accounts are free
       to mint too). When the round is decided with ``member_of`` (by ``tick``), a member of
       ``c``'s group that has no claim of its own for ``r`` (it died during the all-reduce,
       after its reducer served ``c``) attests by its **voucher**: its signed receipt for
       ``c``'s parts, which ``c``'s report carries (``protocol.receipts``, checked in
       ``coordinator.rounds``), under the same account and age rules (its key admitted and
       not revoked). A voucher attests the weight, not the digest: it is that member's word
       given before the round's state existed, worth what its report would be less the
       digest, which in a group of two its report could not check either. No attester: DENIED.
    4. A strict majority of the attesters' reducers bounded or refused ``c``'s contribution
       (robust averaging: a clipped part, a capped weight, a part that did not decode): a
       clipped contribution is not attested work. DENIED, naming how many and the first reason.
    5. granted = min(c.samples, floor(median of the attested weights),
       floor(max_samples_per_second * c.duration_s)); the reason names each bound that bound.
       granted == 0: DENIED, "nothing to grant".
    Decisions are returned sorted by (round, key).

    **In absentia.** A member whose report never comes (killed after its round landed, its
    machine gone) still put its samples into the model its group agreed on. When a round is
    decided by time and ``tick`` was given ``member_of``, every member its claims name that did
    not report is decided by ``decide_absent``: credited if at least ``MIN_ABSENT_WITNESSES``
    accounts attest it under rules 2-4 (a key the run never admitted, or revoked, gets nothing);
    granted = min(floor(median of the attested weights), floor(max_samples_per_second x the
    median of its witnesses' durations)). Nothing is recorded for a member it does not credit.
    A member credited in absentia attests nobody, and a report of its own for that round
    arriving later is refused as a second claim.
    """

    def __init__(
        self,
        *,
        max_samples_per_second: float,
        finalize_after_s: float = 60.0,
        retain_s: float | None = None,
        min_attester_age_s: float = 0.0,
    ) -> None:
        if not (math.isfinite(max_samples_per_second) and max_samples_per_second > 0):
            raise ValueError(f"max_samples_per_second must be a positive number, got {max_samples_per_second!r}")
        if not (math.isfinite(min_attester_age_s) and min_attester_age_s >= 0):
            raise ValueError(f"min_attester_age_s must be a number >= 0, got {min_attester_age_s!r}")
        self.min_attester_age_s = float(min_attester_age_s)
        if not (math.isfinite(finalize_after_s) and finalize_after_s >= 0):
            raise ValueError(f"finalize_after_s must be a number >= 0, got {finalize_after_s!r}")
        self.max_samples_per_second = float(max_samples_per_second)
        self.finalize_after_s = float(finalize_after_s)
        self.retain_s = 10 * self.finalize_after_s if retain_s is None else float(retain_s)
        self._rounds: dict[int, _Round] = {}
        self._forgotten: dict[int, None] = {}
        """Forgotten round numbers, oldest first (a dict keeps insertion order)."""

    def has(self, key: str, round_: int) -> bool:
        """Whether ``key`` has a claim for ``round_`` here (pending or decided, in absentia
        included, not forgotten)."""
        entry = self._rounds.get(round_)
        return entry is not None and (key in entry.claims or key in entry.absent)

    def check(self, claim: RoundClaim) -> None:
        """``ValueError`` naming what is wrong if ``add`` would refuse ``claim``; changes nothing."""
        _check_claim(claim)
        if claim.round in self._forgotten:
            raise ValueError(f"round {claim.round} is closed: it was settled and forgotten")
        if self.has(claim.key, claim.round):
            raise ValueError(f"a second claim by {claim.key} for round {claim.round}")

    def add(self, claim: RoundClaim) -> None:
        """Queue a claim; ``ValueError`` naming what is wrong if it is malformed, repeats a
        (key, round) already claimed, or is for a round already forgotten."""
        self.check(claim)
        self._rounds.setdefault(claim.round, _Round()).add(claim)

    def pending(self) -> int:
        """How many claims are waiting for a decision."""
        return sum(len(r.pending()) for r in self._rounds.values())

    def tick(self, now: float, member_of: MemberOf | None = None) -> list[ClaimVerdict]:
        """Decide every due claim (see the class docstring); each claim is returned once. With
        ``member_of``, vouchers attest (rule 3) and a round decided by time also credits its
        unreported members in absentia."""
        decisions: list[ClaimVerdict] = []
        for number in sorted(self._rounds):
            entry = self._rounds[number]
            pending = entry.pending()
            if not pending:
                continue
            by_time = now - entry.first_received >= self.finalize_after_s
            if not (by_time or entry.complete()):
                continue
            for key in pending:
                decisions.append(
                    decide(
                        entry.claims[key],
                        entry.claims,
                        self.max_samples_per_second,
                        min_attester_age_s=self.min_attester_age_s,
                        member_of=member_of,
                        views=entry.views(key),
                    )
                )
                entry.decided.add(key)
            if by_time and member_of is not None:
                decisions.extend(self._credit_absent(number, entry, now, member_of))
        decisions.sort(key=lambda d: (d.round, d.key))
        self._forget(now)
        for d in decisions:
            logger.info("round %d, %s: %s (%s)", d.round, d.key, d.status.value, d.reason)
        return decisions

    def _credit_absent(self, number: int, entry: _Round, now: float, member_of: MemberOf) -> list[ClaimVerdict]:
        credited = []
        for key in entry.unreported():
            owner = member_of(key, number)
            if owner is None:
                continue
            verdict = decide_absent(
                key,
                number,
                entry.claims,
                self.max_samples_per_second,
                account=owner[0],
                now=now,
                min_attester_age_s=self.min_attester_age_s,
                views=entry.views(key),
            )
            if verdict is not None and verdict.in_absentia is not None:
                entry.absent[key] = verdict.in_absentia
                credited.append(verdict)
        return credited

    def _forget(self, now: float) -> None:
        for number in sorted(self._rounds):
            entry = self._rounds[number]
            if not entry.pending() and now - entry.first_received >= self.retain_s:
                del self._rounds[number]
                self._forgotten[number] = None
                while len(self._forgotten) > MAX_FORGOTTEN:
                    del self._forgotten[next(iter(self._forgotten))]


@dataclass(frozen=True)
class _Witness:
    """One account's word on a claim: its report's view of the claimant, or its voucher."""

    key: str
    weight: float
    offence: str
    voucher: bool = False


def decide(
    claim: RoundClaim,
    claims: dict[str, RoundClaim],
    max_samples_per_second: float,
    *,
    min_attester_age_s: float = 0.0,
    member_of: MemberOf | None = None,
    views: list[RoundClaim] | None = None,
) -> ClaimVerdict:
    """Decide ``claim`` against all claims of its round (keyed by reporter); see ``RoundLedger``.
    ``views``: the round's claims whose group lists ``claim``'s key, in arrival order, where the
    caller keeps them (``_Round.views``); else found by a scan of ``claims``."""
    if len(claim.group) == 1:
        return _denied(claim, "averaged with nobody: its group lists only itself")
    if views is None:
        views = [c for c in claims.values() if c.weight_for(claim.key) is not None]
    # the group's reports vote on the round's state (protocol.agreement): a tie grants nobody
    agreed = agreed_state(Vote(c.key, claim.round, c.state_digest) for c in views)
    if agreed is None:
        return _denied(claim, f"no majority digest among the {len(views)} reports of its group")
    digest, count = agreed.digest, agreed.votes
    if claim.state_digest != digest:
        return _denied(claim, f"digest differs from the group's ({count} of {len(views)} reports agree on {digest})")
    witnesses: dict[str, _Witness] = {}
    too_young = set()
    for c in sorted(views, key=lambda c: c.key):
        if c.key != claim.key and c.state_digest == digest and c.owner != claim.owner:
            if min_attester_age_s > 0 and not c.received_at - c.owner_since >= min_attester_age_s:
                too_young.add(c.owner)
                continue
            view = next(m for m in c.group if m.key == claim.key)
            witnesses.setdefault(c.owner, _Witness(c.key, view.weight, view.offence))
    if member_of is not None:
        too_young |= _vouchers(claim, claims, witnesses, member_of, min_attester_age_s)
    others = len(claim.group) - 1
    if not witnesses:
        young = (
            f"; {len(too_young)} account(s) younger than the run's min_attester_age_s ({min_attester_age_s:g} s)"
            if too_young
            else ""
        )
        return _denied(claim, f"no group member of another account attests it (its group lists {others} others{young})")
    accusers = sorted((w for w in witnesses.values() if w.offence), key=lambda w: w.key)
    if 2 * len(accusers) > len(witnesses):
        first = accusers[0]
        return _denied(
            claim,
            f"its contribution was bounded by {len(accusers)} of {len(witnesses)} attesting members' "
            f"{OFFENCE} ({first.key}: {first.offence})",
        )
    attested = sorted(w.weight for w in witnesses.values())
    vouched = sum(1 for w in witnesses.values() if w.voucher)
    return _grant(claim, attested, others, max_samples_per_second, vouched)


def _vouchers(
    claim: RoundClaim,
    claims: dict[str, RoundClaim],
    witnesses: dict[str, _Witness],
    member_of: MemberOf,
    min_attester_age_s: float,
) -> set[str]:
    """Add to ``witnesses`` the vouchers of ``claim``'s group members that have no claim of
    their own for the round (rule 3); returns the accounts too young to attest."""
    too_young = set()
    for member in sorted(claim.group, key=lambda m: m.key):
        if member.voucher is None or member.key == claim.key or member.key in claims:
            continue
        owner = member_of(member.key, claim.round)
        if owner is None:  # never admitted, revoked, or it holds a claim after all
            continue
        account, since = owner
        account = account or member.key
        if account == claim.owner or account in witnesses:
            continue
        if min_attester_age_s > 0 and not claim.received_at - since >= min_attester_age_s:
            too_young.add(account)
            continue
        witnesses[account] = _Witness(member.key, member.voucher.weight, member.voucher.offence, voucher=True)
    return too_young


def decide_absent(
    key: str,
    round_: int,
    claims: dict[str, RoundClaim],
    max_samples_per_second: float,
    *,
    account: str,
    now: float,
    min_attester_age_s: float = 0.0,
    views: list[RoundClaim] | None = None,
) -> ClaimVerdict | None:
    """Credit ``key``, which its round's ``claims`` name but which never reported, in absentia
    (see ``RoundLedger``); None when its witnesses do not suffice (nothing is recorded then).
    ``views`` as ``decide``'s."""
    if views is None:
        views = [c for c in claims.values() if c.weight_for(key) is not None]
    agreed = agreed_state(Vote(c.key, round_, c.state_digest) for c in views)
    if agreed is None:
        return None
    witnesses: dict[str, RoundClaim] = {}
    for c in sorted(views, key=lambda c: c.key):
        if c.state_digest != agreed.digest or c.owner == (account or key):
            continue
        if min_attester_age_s > 0 and not c.received_at - c.owner_since >= min_attester_age_s:
            continue
        witnesses.setdefault(c.owner, c)
    if len(witnesses) < MIN_ABSENT_WITNESSES:
        return None
    if 2 * sum(1 for c in witnesses.values() if c.offence_for(key)) > len(witnesses):
        return None
    attested = sorted(w for c in witnesses.values() if (w := c.weight_for(key)) is not None)
    duration = statistics.median(c.duration_s for c in witnesses.values())
    median, cap = math.floor(statistics.median(attested)), math.floor(max_samples_per_second * duration)
    granted = min(median, cap)
    if granted <= 0:
        return None
    others = max(len(c.group) for c in views) - 1
    bound = f"throughput cap {cap} ({max_samples_per_second:g} samples/s over {duration:g} s)" if cap < median else ""
    reason = (
        f"granted {granted} samples in absentia: its own report never came; attested {median} (median) "
        f"by {len(attested)} of {others} group members{', ' + bound if bound else ''}, digest the group's"
    )
    stand_in = RoundClaim(
        key=key,
        account=account,
        round=round_,
        samples=granted,
        group=(GroupMemberView(key=key, weight=float(median)),)
        + tuple(GroupMemberView(key=c.key, weight=float(c.samples)) for c in witnesses.values()),
        state_digest=agreed.digest,
        duration_s=max(duration, 1e-3),
        received_at=now,
    )
    return ClaimVerdict(key, round_, ClaimStatus.GRANTED, granted, reason, 0, stand_in)


def _grant(claim: RoundClaim, attested: list[float], others: int, max_sps: float, vouched: int = 0) -> ClaimVerdict:
    """Grant the least of the claim, the attested median and the throughput cap."""
    median = math.floor(statistics.median(attested))
    cap = math.floor(max_sps * claim.duration_s)
    granted = min(claim.samples, median, cap)
    witnesses = f"by {len(attested)} of {others} group members"
    if vouched:
        witnesses += f" ({vouched} by the receipt of a member whose report never came)"
    parts = [f"claimed {claim.samples}"] if granted < claim.samples else []
    if median == granted < claim.samples:
        parts.append(f"attested {median} (median) {witnesses}")
    else:
        parts.append(f"attested {witnesses}")
    if cap == granted < claim.samples:
        parts.append(f"throughput cap {cap} ({max_sps:g} samples/s over {claim.duration_s:g} s)")
    parts.append("digest matches the group's")
    if granted <= 0:
        return _denied(claim, "nothing to grant: " + ", ".join(parts))
    reason = f"granted {granted} samples: " + ", ".join(parts)
    return ClaimVerdict(claim.key, claim.round, ClaimStatus.GRANTED, granted, reason, claim.samples)


def _denied(claim: RoundClaim, reason: str) -> ClaimVerdict:
    return ClaimVerdict(claim.key, claim.round, ClaimStatus.DENIED, 0, reason, claim.samples)


def _check_claim(claim: RoundClaim) -> None:
    """Raise ``ValueError`` naming the first malformed field of ``claim``."""
    if not isinstance(claim, RoundClaim):
        raise ValueError(f"expected a RoundClaim, got {type(claim).__name__}")
    if not isinstance(claim.key, str) or not claim.key:
        raise ValueError(f"claim key must be a non-empty string, got {claim.key!r}")
    if not _is_int(claim.round) or claim.round < 0:
        raise ValueError(f"claim round must be a non-negative integer, got {claim.round!r}")
    if not _is_int(claim.samples) or claim.samples < 0:
        raise ValueError(f"claim samples must be a non-negative integer, got {claim.samples!r}")
    if not isinstance(claim.state_digest, str) or not claim.state_digest:
        raise ValueError(f"claim state_digest must be a non-empty string, got {claim.state_digest!r}")
    if not _is_number(claim.duration_s) or not math.isfinite(claim.duration_s) or claim.duration_s <= 0:
        raise ValueError(f"claim duration_s must be finite and > 0, got {claim.duration_s!r}")
    if not _is_number(claim.received_at) or not math.isfinite(claim.received_at):
        raise ValueError(f"claim received_at must be finite, got {claim.received_at!r}")
    _check_group(claim)


def _check_group(claim: RoundClaim) -> None:
    if not isinstance(claim.group, tuple) or not claim.group:
        raise ValueError("claim group must be a non-empty tuple of GroupMemberView")
    seen: set[str] = set()
    for member in claim.group:
        if not isinstance(member, GroupMemberView) or not isinstance(member.key, str) or not member.key:
            raise ValueError(f"claim group member must be a GroupMemberView with a key, got {member!r}")
        if not _is_number(member.weight) or not math.isfinite(member.weight) or member.weight < 0:
            raise ValueError(f"claim group weight for {member.key} must be finite and >= 0, got {member.weight!r}")
        if not isinstance(member.offence, str) or len(member.offence) > MAX_OFFENCE_CHARS:
            raise ValueError(f"claim group offence for {member.key} must be a string of <= {MAX_OFFENCE_CHARS} chars")
        if "\x00" in member.offence:
            raise ValueError(f"claim group offence for {member.key} contains a NUL character")
        if member.voucher is not None:
            _check_voucher(member.key, member.voucher)
        if member.key in seen:
            raise ValueError(f"claim group lists {member.key} twice")
        seen.add(member.key)
    if claim.key not in seen:
        raise ValueError(f"claim group does not list the reporter {claim.key} itself")


def _check_voucher(key: str, voucher: Voucher) -> None:
    if not isinstance(voucher, Voucher):
        raise ValueError(f"claim group voucher for {key} must be a Voucher, got {voucher!r}")
    if not _is_number(voucher.weight) or not math.isfinite(voucher.weight) or voucher.weight < 0:
        raise ValueError(f"claim group voucher weight for {key} must be finite and >= 0, got {voucher.weight!r}")
    if not isinstance(voucher.offence, str) or len(voucher.offence) > MAX_OFFENCE_CHARS or "\x00" in voucher.offence:
        raise ValueError(f"claim group voucher offence for {key} must be a string of <= {MAX_OFFENCE_CHARS} chars")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
