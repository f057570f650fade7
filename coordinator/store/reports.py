"""``ReportWrites``: what a burst of round reports reads and writes, many at a time: the claims
of a batch in one transaction, the clock bounds and first sightings of its peers in one query."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError

from coordinator.store.base import Transactions
from coordinator.store.rows import NewClaim
from coordinator.store.schema import Claim, Peer

_IN_CHUNK = 500
"""Keys per ``IN (...)`` list (SQLite caps a statement's parameters)."""


class ReportWrites(Transactions):
    """The claims table as reports fill it, and the peers' times their first reports read."""

    def record_claims(self, claims: Sequence[NewClaim]) -> set[tuple[str, int]]:
        """Record pending claims in one transaction (reports arrive in bursts: one commit for
        many); the (key, round) of those recorded: not one already recorded, nor a second one of
        the same (key, round) in ``claims``."""
        wanted: dict[tuple[str, int], NewClaim] = {}
        for claim in claims:
            wanted.setdefault((claim.key, claim.round), claim)
        if not wanted:
            return set()
        keys = sorted({key for key, _ in wanted})
        rounds = sorted({round_ for _, round_ in wanted})
        try:
            with self._write() as s:  # plain INSERTs: reports are the coordinator's busiest writes
                found = s.execute(select(Claim.key, Claim.round).where(Claim.key.in_(keys), Claim.round.in_(rounds)))
                for key, round_ in found:
                    wanted.pop((key, round_), None)
                if wanted:
                    s.execute(insert(Claim), [claim.row() for claim in wanted.values()])
        except IntegrityError:
            # another writer (another process) won a race for a unique (key, round): one at a time
            if len(wanted) > 1:
                recorded: set[tuple[str, int]] = set()
                for claim in wanted.values():
                    recorded |= self.record_claims([claim])
                return recorded
            (only,) = wanted
            if self._has_claim(*only):
                return set()
            raise
        return set(wanted)

    def _has_claim(self, key: str, round: int) -> bool:
        with self._read() as s:
            return s.execute(select(Claim.id).where(Claim.key == key, Claim.round == round)).first() is not None

    def first_seen_of_many(self, owners: Collection[str]) -> dict[str, float]:
        """``first_seen`` of each of ``owners`` that was seen (two indexed queries for them all)."""
        found: dict[str, float] = {}
        owners = sorted(owners)
        with self._read() as s:
            for start in range(0, len(owners), _IN_CHUNK):
                chunk = owners[start : start + _IN_CHUNK]
                by_account = select(Peer.account_key, func.min(Peer.first_seen)).where(Peer.account_key.in_(chunk))
                rows = [*s.execute(by_account.group_by(Peer.account_key))]
                rows += [*s.execute(select(Peer.key, Peer.first_seen).where(Peer.key.in_(chunk)))]
                for owner, first in rows:
                    if first is not None:
                        found[owner] = min(float(first), found.get(owner, math.inf))
        return found

    def report_clock_starts(self, keys: Collection[str]) -> dict[str, float]:
        """``report_clock_start`` of each of ``keys`` that has one (two queries for them all)."""
        found: dict[str, float] = {}
        keys = sorted(keys)
        with self._read() as s:
            for start in range(0, len(keys), _IN_CHUNK):
                chunk = keys[start : start + _IN_CHUNK]
                last = select(Claim.key, func.max(Claim.received_at)).where(Claim.key.in_(chunk)).group_by(Claim.key)
                found.update((key, float(at)) for key, at in s.execute(last) if at is not None)
                first = select(Peer.key, Peer.first_seen).where(Peer.key.in_(chunk))
                for key, at in s.execute(first):
                    if key not in found and at is not None:
                        found[key] = float(at)
        return found

    def report_clock_start(self, key: str) -> float | None:
        """When ``key``'s last recorded claim arrived, else when it was first seen; None if
        neither (one indexed query: what a peer's first report after a start reads)."""
        last_claim = select(func.max(Claim.received_at)).where(Claim.key == key).scalar_subquery()
        first_seen = select(Peer.first_seen).where(Peer.key == key).scalar_subquery()
        with self._read() as s:
            found = s.scalar(select(func.coalesce(last_claim, first_seen)))
        return float(found) if found is not None else None
