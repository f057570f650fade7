"""The coordinator's round book: every round report from its arrival to its decision.

A report (``Coordinator.report_round``, already verified: signed, fresh, admitted, in bounds)
becomes a ``RoundClaim`` here (``claim_of``: the duration bounded by the coordinator's own
clock), is checked (a token run's data read; the ledger's rules) and **recorded** in one step
(``record``): the store first (what survives a crash), then, only if the store took it, the
ledger of undecided claims, the round view and the round's figures (training loss, validation
loss, data epoch). ``decide(now)`` turns the ledger's verdicts into the store's decisions, one
transaction per round with the round's record (agreed digest, figures), and returns them so
that the caller moves what follows from a decision (credits shown in heartbeats, health).

Everything here is rebuilt from the store after a restart (``reload``): the undecided claims
(their finalisation clock restarts), the round view of the newest rounds, each peer's last
report time. The figures of rounds not decided yet are lost with the process (a round decided
after a restart records no loss, as documented in ``Store.finalize_round``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from coordinator.credits import MemberOf, RoundLedger
from coordinator.limits import MAX_GROUP
from coordinator.round_view import ROUND_WINDOW, RoundWindow
from coordinator.slots import DataSlots
from coordinator.store import NewClaim, RoundTiming, Store
from coordinator.store.claims import ClaimVerdict, GroupMemberView, RoundClaim, Voucher, claim_from_row, group_json
from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.identity import PublicKey
from protocol.receipts import ReceiptError, read_receipt
from protocol.spec import RunSpec
from protocol.statesync import run_prefix

__all__ = ["RoundBook"]

logger = logging.getLogger(__name__)


class RoundBook:
    """The claims, figures and checks of a run's rounds (see the module doc)."""

    def __init__(
        self, spec: RunSpec, store: Store, *, flops_per_sample: float, data_slots: DataSlots | None = None
    ) -> None:
        self.spec, self.store, self.flops_per_sample, self.data_slots = spec, store, flops_per_sample, data_slots
        self.ledger = RoundLedger(
            max_samples_per_second=spec.credits.max_samples_per_second,
            min_attester_age_s=spec.credits.min_attester_age_s,
        )
        self.run = run_prefix(spec.digest())
        """What a receipt names as its run (``protocol.receipts``)."""
        self.view = RoundWindow(ROUND_WINDOW)
        """Groups, states and peers averaged of the newest rounds reported (``coordinator.round_view``)."""
        self._losses: dict[int, list[float]] = {}
        self._timings: dict[int, dict[str, RoundTiming]] = {}
        """How each reporter's round went (only granted ones count)."""
        self._val_losses: dict[int, dict[str, float]] = {}
        """Validation losses reported per round, by reporter (only granted ones count)."""
        self._epochs: dict[int, dict[str, float]] = {}
        self._data_read: dict[str, int] = {}
        """Token runs: the last data round each peer's recorded reports read (strictly rising)."""
        self._last_report_at: dict[str, float] = {}
        """When each key's last recorded report arrived (from the store the first time)."""
        self.data_epoch = 0.0
        """Token runs: the data order's position in epochs, the highest of the decided rounds'
        lower medians of what granted reporters stated (shown only; 0 again after a restart
        until a round is decided)."""

    def reload(self, *, restarted: float, owner_of: Callable[[str], tuple[str, float]]) -> None:
        """Rebuild from the store after a start: the round view, and the undecided claims with
        their finalisation clock restarted at ``restarted`` (peers re-send their reports when the
        coordinator is back). ``owner_of(key)`` → (its account, when that account was first seen)."""
        self.view.load(self.store.recent_claims(ROUND_WINDOW, limit=ROUND_WINDOW * MAX_GROUP))
        for row in self.store.pending_claims():
            claim = claim_from_row(row)
            account, since = owner_of(claim.key)
            self.ledger.add(dataclasses.replace(claim, received_at=restarted, account=account, owner_since=since))

    # --- a report ---------------------------------------------------------------------------

    def claim_of(
        self, key: str, body: pb.RoundReportBody, *, now: float, account: str, owner_since: float
    ) -> RoundClaim:
        """The claim a verified report of ``key`` makes; raises ``MalformedMessageError`` for a
        group member that is no public key."""
        group = []
        for member in body.group:
            try:
                member_key = PublicKey(bytes(member.public_key)).id
            except Exception as exc:
                raise MalformedMessageError(f"round report names a malformed group member key ({exc})") from exc
            voucher = self._voucher(member_key, member.receipt, key, body.round)
            group.append(GroupMemberView(key=member_key, weight=member.weight, offence=member.offence, voucher=voucher))
        duration = min(max(body.compute_s + body.wait_s, 1e-3), self._observed_round_s(key, now))
        return RoundClaim(
            key=key,
            account=account,
            owner_since=owner_since,
            round=body.round,
            samples=body.samples,
            group=tuple(group),
            state_digest=body.state_digest,
            duration_s=duration,
            received_at=now,
        )

    def _voucher(self, member: str, receipt: bytes, reporter: str, round_: int) -> Voucher | None:
        """``member``'s receipt for ``reporter``'s parts in ``round_``, if the report carried one
        that holds (``protocol.receipts``); one that does not is dropped, never the report: it
        came from another member, whom the reporter cannot vouch for."""
        if not receipt or member == reporter:
            return None
        try:
            read = read_receipt(bytes(receipt), reducer=member, run=self.run, round_=round_, sender=reporter)
        except ReceiptError as exc:
            logger.info(
                "round %d: %s's report carries a receipt of %s that does not hold: %s", round_, reporter, member, exc
            )
            return None
        return Voucher(weight=read.weight, offence=read.offence)

    def prefetch_clocks(self, keys: set[str]) -> None:
        """Read the clock bounds of those of ``keys`` this process has not seen report yet in
        one query (``_observed_round_s`` reads them one by one otherwise: after a start, every
        peer's first report, all in the same burst)."""
        unseen = keys - self._last_report_at.keys()
        if unseen:
            self._last_report_at.update(self.store.report_clock_starts(unseen))

    def already_reported(self, key: str, round_: int) -> bool:
        """Whether the ledger holds an undecided claim of ``key`` for ``round_``."""
        return self.ledger.has(key, round_)

    def record(self, claim: RoundClaim, body: pb.RoundReportBody) -> bool:
        """Check and record one claim (its report ``body`` says the figures): False if the store
        already holds it (nothing changes). Raises ``ValueError`` for a claim the rules refuse
        (malformed, a closed round, a data read that does not add up); nothing changes then."""
        (outcome,) = self.record_many([(claim, body)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def record_many(self, reports: list[tuple[RoundClaim, pb.RoundReportBody]]) -> list[bool | ValueError]:
        """``record`` for claims of distinct keys, the store's part in one transaction: for each,
        True (recorded), False (the store held it already) or the ``ValueError`` that refuses it."""
        outcomes: list[bool | ValueError] = []
        checked: list[RoundClaim] = []
        for claim, body in reports:
            try:
                self._check_data_read(claim.key, body)
                self.ledger.check(claim)
            except ValueError as exc:
                outcomes.append(exc)
                continue
            outcomes.append(True)
            checked.append(claim)
        recorded = self.store.record_claims(
            [
                NewClaim(c.key, c.round, c.samples, group_json(c), c.state_digest, c.duration_s, c.received_at)
                for c in checked
            ]
        )
        for index, (claim, body) in enumerate(reports):
            if outcomes[index] is True:
                if (claim.key, claim.round) in recorded:
                    self._remember(claim, body)
                else:
                    outcomes[index] = False
        return outcomes

    def _remember(self, claim: RoundClaim, body: pb.RoundReportBody) -> None:
        """What a recorded claim adds to the ledger, the round view and the round's figures."""
        self.ledger.add(claim)
        self.view.add(
            round=claim.round, reporter=claim.key, members=(m.key for m in claim.group), state_digest=claim.state_digest
        )
        # the time this claim drew from the peer's clock bound (``_observed_round_s``): the
        # next report's bound starts where this one's duration ends, not at its arrival
        since = self._last_report_at.get(claim.key, claim.received_at - claim.duration_s)
        self._last_report_at[claim.key] = min(claim.received_at, since + claim.duration_s)
        if math.isfinite(body.loss):
            self._losses.setdefault(claim.round, []).append(body.loss)
        self._timings.setdefault(claim.round, {})[claim.key] = RoundTiming(
            compute_s=body.compute_s,
            # the search as the peer timed it; a peer that says nothing of it (older software):
            # its wait beyond the all-reduce, which overlap hides
            matchmaking_s=body.matchmaking_s or max(0.0, body.wait_s - body.allreduce_s),
            allreduce_s=body.allreduce_s,
            landing_s=body.host_s,
            bytes_sent=float(body.bytes_sent),
            bytes_received=float(body.bytes_received),
        )
        if body.HasField("data"):
            self._data_read[claim.key] = body.data.round
            self._epochs.setdefault(claim.round, {})[claim.key] = body.data.epoch
        if body.HasField("validation_loss") and math.isfinite(body.validation_loss):
            self._val_losses.setdefault(claim.round, {})[claim.key] = body.validation_loss

    # --- time -------------------------------------------------------------------------------

    def decide(self, now: float, member_of: MemberOf | None = None) -> list[ClaimVerdict]:
        """Decide the rounds the ledger can decide at ``now``; each round's verdicts (their
        granted samples' FLOPs added) and its record are committed in one transaction
        (``Store.finalize_round``). What was committed. With ``member_of``
        (``RoundLedger.tick``), a round decided by time credits its members whose reports never
        came in absentia, their claims recorded with the decisions."""
        verdicts: dict[int, list[ClaimVerdict]] = {}
        for verdict in self.ledger.tick(now, member_of):
            flops = verdict.granted_samples * self.flops_per_sample
            verdicts.setdefault(verdict.round, []).append(dataclasses.replace(verdict, flops=flops))
        decided: list[ClaimVerdict] = []
        for round_, round_verdicts in sorted(verdicts.items()):
            self.view.decided(round_)
            losses = self._losses.pop(round_, [])
            granted = {verdict.key for verdict in round_verdicts if verdict.granted}
            val_loss = _lower_median(self._val_losses.pop(round_, {}), granted)
            epoch = _lower_median(self._epochs.pop(round_, {}), granted)
            timing = _timing(self._timings.pop(round_, {}), granted)
            if epoch is not None:
                self.data_epoch = max(self.data_epoch, epoch)
            self.store.finalize_round(
                round=round_,
                decisions=round_verdicts,
                now=now,
                mean_loss=sum(losses) / len(losses) if losses else None,
                validation_loss=val_loss,
                timing=timing,
            )
            decided.extend(round_verdicts)
        return decided

    # --- checks -----------------------------------------------------------------------------

    def _check_data_read(self, key: str, body: pb.RoundReportBody) -> None:
        """Token runs: a report that claims samples says what it read, from a stream it holds
        (``peer.task.data_assignment`` lets anyone recompute the ids from it). Raises ValueError."""
        if self.data_slots is None:
            if body.HasField("data"):
                raise ValueError("round report names a data stream, but this run hands out none")
            return
        if not body.HasField("data"):
            if body.samples > 0:
                raise ValueError("a token run's round report must say what it read (data stream, steps, ids digest)")
            return
        held = self.data_slots.held_by(key)
        if body.data.slot not in held:
            raise ValueError(f"round report reads data stream {body.data.slot}, but this peer holds {held or 'none'}")
        inner_steps = self.spec.rounds.inner_steps or 0
        if not 0 <= body.data.steps <= inner_steps:
            raise ValueError(f"round report reads {body.data.steps} steps of data; a round has {inner_steps}")
        if body.data.round <= self._data_read.get(key, -1):
            raise ValueError(
                f"round report reads data round {body.data.round} again (this peer last read {self._data_read[key]})"
            )
        most = body.data.steps * self.spec.inner.batch_size * len(held)
        if body.samples > most:
            raise ValueError(f"round report claims {body.samples} samples but read {most} sequences")

    def _observed_round_s(self, key: str, now: float) -> float:
        """The longest a round of ``key`` can have taken by the coordinator's own clock: the
        time since what its earlier claims drew ended, or since it was first seen. A claim's
        throughput cap uses this, never less than 1 ms, whatever time the peer says it spent.
        Each recorded claim draws its own duration (``record``): the durations of all of a
        key's claims add up to at most the time the coordinator saw it, and reports that
        arrive together (a peer's backlog when the coordinator is back from an outage) share
        the time since the last one. Drawing the whole gap at each arrival, as this once did,
        gave the second report of a backlog a few milliseconds and capped its credit to
        nothing. After a restart the bound starts at the key's last claim's arrival (the
        store keeps it), which never allows more."""
        since = self._last_report_at.get(key)
        if since is None:  # this process has not seen it report yet: the store knows
            since = self.store.report_clock_start(key)
            since = now if since is None else since
            self._last_report_at[key] = since
        return max(now - since, 1e-3)


def _lower_median(values: dict[str, float], keys: set[str]) -> float | None:
    """The lower median of ``values`` of ``keys``: none of them can raise it alone, and with
    three or more reporters no single one can move it at all; None if none reported."""
    chosen = sorted(value for key, value in values.items() if key in keys)
    return chosen[(len(chosen) - 1) // 2] if chosen else None


def _timing(reported: dict[str, RoundTiming], keys: set[str]) -> RoundTiming | None:
    """Each figure the lower median of what ``keys`` reported (None: none of them reported)."""
    if not any(key in keys for key in reported):
        return None
    figures = {
        name: _lower_median({key: getattr(t, name) for key, t in reported.items()}, keys)
        for name in (f.name for f in dataclasses.fields(RoundTiming))
    }
    return RoundTiming(**figures)
