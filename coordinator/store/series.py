"""``SwarmSeries``: the swarm's time series (peers online, samples a second, failed rounds),
one point per coordinator tick, pruned to a window (the dashboard's charts)."""

from __future__ import annotations

import logging

from sqlalchemy import delete, select

from coordinator.store.base import Transactions
from coordinator.store.rows import SwarmPoint
from coordinator.store.schema import SwarmSample

logger = logging.getLogger(__name__)

_SAMPLE_FIELDS = ("at", "peers_online", "samples_per_second", "rounds_failed")


class SwarmSeries(Transactions):
    """The ``swarm_samples`` table: appended, read since a time, pruned before one."""

    def record_sample(
        self, *, now: float, peers_online: int, samples_per_second: float, rounds_failed: int = 0
    ) -> None:
        """Append one point of the swarm time series (``at`` = now)."""
        with self._write() as s:
            s.add(
                SwarmSample(
                    at=now,
                    peers_online=peers_online,
                    samples_per_second=samples_per_second,
                    rounds_failed=rounds_failed,
                )
            )

    def samples(self, since: float) -> list[SwarmPoint]:
        """Points with ``at >= since``, oldest first."""
        query = select(SwarmSample).where(SwarmSample.at >= since).order_by(SwarmSample.at, SwarmSample.id)
        with self._read() as s:
            return [SwarmPoint(**{name: getattr(p, name) for name in _SAMPLE_FIELDS}) for p in s.scalars(query)]

    def prune_samples(self, before: float) -> int:
        """Delete points with ``at < before``; returns how many were deleted."""
        with self._write() as s:
            result = s.execute(delete(SwarmSample).where(SwarmSample.at < before))
        deleted = int(getattr(result, "rowcount", 0) or 0)
        logger.debug("pruned %d swarm samples before %s", deleted, before)
        return deleted
