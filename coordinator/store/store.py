"""``Store``: everything the coordinator must not lose, behind one small typed API."""

from __future__ import annotations

import dataclasses
import logging

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from coordinator.store.claims import ClaimStatus, ClaimVerdict
from coordinator.store.claims import group_json as as_json
from coordinator.store.reports import ReportWrites
from coordinator.store.rows import (
    BanRow,
    ClaimRow,
    CreditTotals,
    LeaderRow,
    NewClaim,
    PeerCredit,
    PeerRow,
    RoundRow,
    RoundTiming,
    RunRow,
)
from coordinator.store.schema import (
    DENIED,
    GRANTED,
    PENDING,
    Allowed,
    Ban,
    Claim,
    Credit,
    DataSlot,
    Peer,
    RoundRecord,
    Run,
)
from coordinator.store.series import SwarmSeries
from protocol.agreement import Vote, agreed_state

logger = logging.getLogger(__name__)

_RUN_ID = 1
_CLAIM_FIELDS = (
    "key",
    "round",
    "samples",
    "group_json",
    "state_digest",
    "duration_s",
    "received_at",
    "status",
    "granted_samples",
    "flops",
    "reason",
    "decided_at",
)
_PEER_FIELDS = (
    "key",
    "account_key",
    "libp2p_peer_id",
    "software_version",
    "hardware_json",
    "reachable",
    "first_seen",
    "last_seen",
)
_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(RoundTiming))
_ROUND_FIELDS = (
    "round",
    "state_digest",
    "finalized_at",
    "group_size",
    "mean_loss",
    "samples",
    "validation_loss",
    "states",
    *_TIMING_FIELDS,
)


class Store(ReportWrites, SwarmSeries):
    """The coordinator's database (SQLite by default, any SQLAlchemy URL).

    Tables: ``schema_version`` (version, applied_at), ``run`` (one row: spec_digest,
    spec_toml, name), ``allowlist`` (account_key), ``bans`` (peer_key, reason, banned_at),
    ``peers`` (key, account_key, libp2p_peer_id, software_version, hardware_json, reachable,
    first_seen, last_seen), ``claims`` (key, round unique together; samples, group_json,
    state_digest, duration_s, received_at, status pending|granted|denied, granted_samples,
    flops, reason, decided_at), ``credits`` (the append-only ledger: one row per granted
    claim, unique by claim and by (key, round)), ``rounds`` (round, state_digest,
    finalized_at, group_size, mean_loss, samples) and ``swarm_samples`` (at, peers_online,
    samples_per_second; ``prune_samples`` deletes old ones).

    Commits and crash safety: ``coordinator.store.base.Transactions``. ``finalize_round`` (and
    ``decide_claim``) update a claim and append its credit in the same transaction, so the
    ledger never holds a credit without its granted claim or the reverse. The swarm's time
    series: ``coordinator.store.series.SwarmSeries``.
    """

    # --- run --------------------------------------------------------------------------------

    def set_run(self, *, spec_digest: str, spec_toml: str, name: str) -> None:
        """Record the run this coordinator serves, replacing any earlier one (logged)."""
        with self._write() as s:
            run = s.get(Run, _RUN_ID)
            if run is None:
                s.add(Run(id=_RUN_ID, spec_digest=spec_digest, spec_toml=spec_toml, name=name))
                return
            if run.spec_digest != spec_digest:
                logger.warning(
                    "database held run %s (%s); now serving %s (%s)", run.name, run.spec_digest, name, spec_digest
                )
            run.spec_digest, run.spec_toml, run.name = spec_digest, spec_toml, name

    def run(self) -> RunRow | None:
        """The recorded run, or None."""
        with self._read() as s:
            run = s.get(Run, _RUN_ID)
            return None if run is None else RunRow(spec_digest=run.spec_digest, spec_toml=run.spec_toml, name=run.name)

    # --- admission --------------------------------------------------------------------------

    def allow(self, account_key: str) -> None:
        """Put an account on the allowlist; allowing it again is a no-op."""
        with self._write() as s:
            if s.get(Allowed, account_key) is None:
                s.add(Allowed(account_key=account_key))

    def disallow(self, account_key: str) -> None:
        """Take an account off the allowlist; a no-op if it is not on it."""
        with self._write() as s:
            s.execute(delete(Allowed).where(Allowed.account_key == account_key))

    def allowlist(self) -> set[str]:
        """Every allowed account key."""
        with self._read() as s:
            return set(s.scalars(select(Allowed.account_key)))

    def ban(self, peer_key: str, reason: str, now: float) -> None:
        """Ban a peer key; banning it again replaces the reason and time."""
        with self._write() as s:
            ban = s.get(Ban, peer_key)
            if ban is None:
                s.add(Ban(peer_key=peer_key, reason=reason, banned_at=now))
            else:
                ban.reason, ban.banned_at = reason, now
        logger.info("banned %s: %s", peer_key, reason)

    def unban(self, peer_key: str) -> None:
        """Lift a ban; a no-op if the key is not banned."""
        with self._write() as s:
            s.execute(delete(Ban).where(Ban.peer_key == peer_key))

    def bans(self) -> list[BanRow]:
        """Every ban, oldest first."""
        with self._read() as s:
            return [
                BanRow(key=b.peer_key, reason=b.reason, banned_at=b.banned_at)
                for b in s.scalars(select(Ban).order_by(Ban.banned_at, Ban.peer_key))
            ]

    def banned(self) -> dict[str, str]:
        """``{peer_key: reason}`` for every banned peer."""
        with self._read() as s:
            return {b.peer_key: b.reason for b in s.scalars(select(Ban))}

    # --- peers ------------------------------------------------------------------------------

    def upsert_peer(
        self,
        *,
        key: str,
        account_key: str | None,
        libp2p_peer_id: str,
        software_version: str,
        hardware_json: str,
        reachable: bool,
        now: float,
    ) -> None:
        """Insert or update a peer; ``first_seen`` keeps its first value, ``last_seen`` = now."""
        fields = dict(
            account_key=account_key,
            libp2p_peer_id=libp2p_peer_id,
            software_version=software_version,
            hardware_json=hardware_json,
            reachable=int(reachable),
            last_seen=now,
        )
        with self._write() as s:
            peer = s.get(Peer, key)
            if peer is None:
                s.add(Peer(key=key, first_seen=now, **fields))
            else:
                for name, value in fields.items():
                    setattr(peer, name, value)

    def peer(self, key: str) -> PeerRow | None:
        """One peer's row (as in ``peers``), or None if it was never seen."""
        with self._read() as s:
            row = s.get(Peer, key)
            return _peer_row(row) if row is not None else None

    def first_seen(self, owner: str) -> float | None:
        """When ``owner`` was first seen: the earliest ``first_seen`` of the peers whose account
        or own key it is; None if none."""
        # two indexed lookups: "account_key = owner OR key = owner" scanned the whole table
        by_account = select(func.min(Peer.first_seen)).where(Peer.account_key == owner).scalar_subquery()
        by_key = select(Peer.first_seen).where(Peer.key == owner).scalar_subquery()
        with self._read() as s:
            found = [v for v in s.execute(select(by_account, by_key)).one() if v is not None]
        return float(min(found)) if found else None

    def peers(self) -> list[PeerRow]:
        """Every peer ever seen, by key."""
        with self._read() as s:
            return [_peer_row(p) for p in s.scalars(select(Peer).order_by(Peer.key))]

    # --- claims and credits (the ledger) ----------------------------------------------------

    def record_claim(
        self,
        *,
        key: str,
        round: int,
        samples: int,
        group_json: str,
        state_digest: str,
        duration_s: float,
        received_at: float,
    ) -> bool:
        """Record a pending claim; False (nothing changed) if (key, round) is already recorded."""
        claim = NewClaim(key, round, samples, group_json, state_digest, duration_s, received_at)
        return bool(self.record_claims([claim]))

    def decide_claim(
        self,
        *,
        key: str,
        round: int,
        status: str,
        granted_samples: int,
        flops: float,
        reason: str,
        now: float,
    ) -> None:
        """Decide a pending claim and, if granted, append its credit: one transaction.

        Deciding an already decided claim is a no-op (the first decision stands). Raises
        ``ValueError`` for a status other than granted/denied, negative amounts or a claim
        that was never recorded.
        """
        try:
            verdict = ClaimStatus(status)
        except ValueError:
            raise ValueError(f"claim status must be {GRANTED!r} or {DENIED!r}, not {status!r}") from None
        decision = ClaimVerdict(key, round, verdict, granted_samples, reason, flops=flops)
        with self._write() as s:
            _decide(s, round, decision, now)

    def finalize_round(
        self,
        *,
        round: int,
        decisions: list[ClaimVerdict],
        mean_loss: float | None,
        now: float,
        validation_loss: float | None = None,
        timing: RoundTiming | None = None,
    ) -> None:
        """Decide ``decisions`` (claims of ``round``) and write the round's record: one transaction.

        The record is computed from the round's claims, those decided earlier included: the
        state digest a strict majority of the granted ones hold ("" on a tie), the number of
        claims (group size) and the granted samples. A round with no granted claim has no
        record: one
        peer's denied report (of round 2**31 - 1, say) is not a round of the swarm, and must
        not become its current round in status and joins, nor the archive's digest. ``mean_loss``,
        ``validation_loss`` and ``timing`` None keep a value recorded earlier; ``states`` counts
        the distinct digests of the granted claims. A crash leaves either all of
        it or none of it. Raises ``ValueError`` like ``decide_claim``; nothing is written then.
        """
        with self._write() as s:
            for decision in decisions:
                _decide(s, round, decision, now)
            claims = list(s.scalars(select(Claim).where(Claim.round == round)))
            granted = [c for c in claims if c.status == GRANTED]
            if not granted:
                return
            # the round's reporters vote (protocol.agreement); a tie records no digest ("")
            agreed = agreed_state(Vote(c.key, round, c.state_digest) for c in granted)
            majority = agreed.digest if agreed is not None else ""
            record = s.get(RoundRecord, round)
            if record is None:
                record = RoundRecord(round=round)
                s.add(record)
            else:
                mean_loss = record.mean_loss if mean_loss is None else mean_loss
                validation_loss = record.validation_loss if validation_loss is None else validation_loss
            if timing is not None:
                for name in _TIMING_FIELDS:
                    setattr(record, name, getattr(timing, name))
            record.states = len({c.state_digest for c in granted if c.state_digest})
            record.state_digest, record.finalized_at, record.group_size = majority, now, len(claims)
            record.mean_loss = mean_loss
            record.validation_loss = validation_loss
            record.samples = sum(c.granted_samples or 0 for c in granted)

    def pending_claims(self) -> list[ClaimRow]:
        """Every undecided claim, oldest first (what the ledger reloads after a restart)."""
        with self._read() as s:
            query = select(Claim).where(Claim.status == PENDING).order_by(Claim.id)
            return [_claim_row(c) for c in s.scalars(query)]

    def claims(self, *, key: str | None = None, round: int | None = None, limit: int = 1000) -> list[ClaimRow]:
        """Claims, newest recorded first, optionally of one peer and/or one round."""
        query = select(Claim).order_by(Claim.id.desc()).limit(limit)
        if key is not None:
            query = query.where(Claim.key == key)
        if round is not None:
            query = query.where(Claim.round == round)
        with self._read() as s:
            return [_claim_row(c) for c in s.scalars(query)]

    def recent_claims(self, rounds: int, *, limit: int) -> list[ClaimRow]:
        """The claims of the ``rounds`` highest rounds claimed, at most ``limit`` rows (the round
        view's restart)."""
        with self._read() as s:
            latest = list(s.scalars(select(Claim.round).distinct().order_by(Claim.round.desc()).limit(rounds)))
            if not latest:
                return []
            query = select(Claim).where(Claim.round.in_(latest)).limit(limit)
            return [_claim_row(c) for c in s.scalars(query)]

    def denials_by_peer(self, reason_contains: str) -> dict[str, int]:
        """``{peer_key: count}`` of denied claims whose reason contains ``reason_contains``."""
        query = (
            select(Claim.key, func.count(Claim.id))
            .where(Claim.status == DENIED, Claim.reason.contains(reason_contains, autoescape=True))
            .group_by(Claim.key)
        )
        with self._read() as s:
            return {key: int(count) for key, count in s.execute(query)}

    def credits_by_peer(self) -> dict[str, CreditTotals]:
        """Each credited peer's totals over every granted claim."""
        query = select(Credit.key, func.sum(Credit.samples), func.sum(Credit.flops), func.count(Credit.id))
        with self._read() as s:
            return {
                k: CreditTotals(samples=int(n), flops=float(f), rounds=int(r))
                for k, n, f, r in s.execute(query.group_by(Credit.key))
            }

    def granted_samples(self) -> int:
        """Samples granted to every peer so far (one aggregate over the ledger)."""
        with self._read() as s:
            return int(s.scalar(select(func.coalesce(func.sum(Credit.samples), 0))) or 0)

    def credit_of(self, key: str) -> PeerCredit:
        """One peer's credit: granted so far, and claimed but not decided yet (its heartbeats
        show it this; both sums use the (key, round) indexes). One statement, so one snapshot:
        read as two, a decision committed between them (a claim moving from pending to
        granted) was counted in neither."""
        granted = (
            select(func.coalesce(func.sum(Credit.samples), 0), func.coalesce(func.sum(Credit.flops), 0.0))
            .where(Credit.key == key)
            .subquery()
        )
        pending = select(func.coalesce(func.sum(Claim.samples), 0)).where(Claim.key == key, Claim.status == PENDING)
        both = select(granted, pending.scalar_subquery())
        with self._read() as s:
            samples, flops, pending_samples = s.execute(both).one()
            return PeerCredit(samples=int(samples), flops=float(flops), pending_samples=int(pending_samples or 0))

    def leaderboard(self, limit: int = 20) -> list[LeaderRow]:
        """Accounts by flops (then samples) descending; a peer with no account counts as its own."""
        account = func.coalesce(Peer.account_key, Credit.key).label("account_key")
        flops, samples = func.sum(Credit.flops), func.sum(Credit.samples)
        query = (
            select(account, samples, flops, func.count(func.distinct(Credit.key)))
            .select_from(Credit)
            .outerjoin(Peer, Peer.key == Credit.key)
            .group_by(account)
            .order_by(flops.desc(), samples.desc(), account)
            .limit(limit)
        )
        with self._read() as s:
            return [
                LeaderRow(account_key=a, samples=int(n), flops=float(f), peers=int(p))
                for a, n, f, p in s.execute(query)
            ]

    # --- data streams of token runs ---------------------------------------------------------

    def data_slots(self) -> dict[int, str]:
        """Every assigned data stream and the peer holding it."""
        with self._read() as s:
            return {row.slot: row.peer_key for row in s.scalars(select(DataSlot))}

    def assign_data_slots(self, *, peer_key: str, slots: list[int], now: float, evicted: tuple[str, ...] = ()) -> None:
        """Give ``slots`` to ``peer_key`` (taking them from whoever held them) and nothing else;
        ``evicted`` peers lose every stream they held. One transaction."""
        with self._write() as s:
            s.execute(delete(DataSlot).where(DataSlot.peer_key.in_((peer_key, *evicted)), DataSlot.slot.not_in(slots)))
            for slot in slots:
                row = s.get(DataSlot, slot)
                if row is None:
                    s.add(DataSlot(slot=slot, peer_key=peer_key, assigned_at=now))
                else:
                    row.peer_key, row.assigned_at = peer_key, now

    def claim_counts(self) -> dict[str, int]:
        """How many claims are pending, granted and denied."""
        query = select(Claim.status, func.count()).group_by(Claim.status)
        with self._read() as s:
            return {str(status): int(count) for status, count in s.execute(query)}

    def release_data_slots(self, peer_key: str) -> None:
        """``peer_key`` holds no data stream any more."""
        with self._write() as s:
            s.execute(delete(DataSlot).where(DataSlot.peer_key == peer_key))

    def latest_validation(self) -> RoundRow | None:
        """The newest round with a validation loss (as in ``rounds``), or None."""
        query = select(RoundRecord).where(RoundRecord.validation_loss.is_not(None))
        with self._read() as s:
            row = s.scalars(query.order_by(RoundRecord.round.desc()).limit(1)).first()
            return _round_row(row) if row is not None else None

    # --- rounds and swarm history -----------------------------------------------------------

    def rounds(self, limit: int = 500) -> list[RoundRow]:
        """The latest ``limit`` rounds, highest round first."""
        query = select(RoundRecord).order_by(RoundRecord.round.desc()).limit(limit)
        with self._read() as s:
            return [_round_row(r) for r in s.scalars(query)]


def _decide(session: Session, round: int, decision: ClaimVerdict, now: float) -> None:
    if decision.round != round:
        raise ValueError(f"a verdict on round {decision.round} among the decisions of round {round}")
    if decision.status not in (GRANTED, DENIED):
        raise ValueError(f"claim status must be {GRANTED!r} or {DENIED!r}, not {decision.status!r}")
    if decision.granted_samples < 0 or decision.flops < 0:
        raise ValueError(f"granted_samples and flops must be >= 0, got {decision.granted_samples} and {decision.flops}")
    claim = _find_claim(session, decision.key, round)
    if claim is None and decision.in_absentia is not None:
        made = decision.in_absentia
        claim = _new_claim(
            decision.key, round, made.samples, as_json(made), made.state_digest, made.duration_s, made.received_at
        )
        session.add(claim)
        session.flush()  # its id, for the credit's claim_id
    if claim is None:
        raise ValueError(f"no claim recorded for peer {decision.key} round {round}")
    if claim.status != PENDING:
        logger.debug("claim %s round %d already %s; ignoring %s", decision.key, round, claim.status, decision.status)
        return
    claim.status, claim.granted_samples, claim.flops = decision.status, decision.granted_samples, decision.flops
    claim.reason, claim.decided_at = decision.reason, now
    if decision.status == GRANTED:
        session.add(
            Credit(
                claim_id=claim.id,
                key=decision.key,
                round=round,
                samples=decision.granted_samples,
                flops=decision.flops,
                granted_at=now,
            )
        )


def _new_claim(
    key: str, round: int, samples: int, group: str, state_digest: str, duration_s: float, received_at: float
) -> Claim:
    return Claim(**NewClaim(key, round, samples, group, state_digest, duration_s, received_at).row())


def _find_claim(session: Session, key: str, round: int) -> Claim | None:
    return session.scalars(select(Claim).where(Claim.key == key, Claim.round == round)).one_or_none()


def _claim_row(claim: Claim) -> ClaimRow:
    return ClaimRow(**{name: getattr(claim, name) for name in _CLAIM_FIELDS})


def _peer_row(peer: Peer) -> PeerRow:
    fields = {name: getattr(peer, name) for name in _PEER_FIELDS}
    return PeerRow(**{**fields, "reachable": bool(fields["reachable"])})


def _round_row(record: RoundRecord) -> RoundRow:
    return RoundRow(**{name: getattr(record, name) for name in _ROUND_FIELDS})
