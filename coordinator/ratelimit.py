"""Requests per source address, bounded before anything is parsed or verified (issue #14).

A signature check costs ~0.1 ms of a core; a flood of requests, signed or not, from one host
must not take the coordinator's cores from everyone else. ``SourceLimiter`` is a token bucket
per source host (the gRPC peer address without its port): ``rate`` requests per second with
bursts of ``burst``. Many honest peers behind one NAT share a bucket, so the default
(``DEFAULT_RATE``) is far above what even a few hundred peers send (a heartbeat every 5 s and
a report per round each). Buckets of hosts not heard from are dropped beyond ``max_sources``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_RATE = 200.0
DEFAULT_BURST = 1000.0
MAX_SOURCES = 100_000


def source_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``,
    ``unix:/path``)."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rsplit(":", 1)[0]
    if kind == "ipv6":
        return address.rsplit("]", 1)[0].lstrip("[") if address.startswith("[") else address
    return peer


class SourceLimiter:
    """Token buckets by source host; ``allow`` is thread-safe."""

    def __init__(
        self, rate: float = DEFAULT_RATE, burst: float = DEFAULT_BURST, *, max_sources: int = MAX_SOURCES
    ) -> None:
        if not (rate > 0 and burst >= 1):
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got {rate!r} and {burst!r}")
        self.rate, self.burst, self.max_sources = float(rate), float(burst), max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, source: str, now: float) -> bool:
        """Take one token from ``source``'s bucket at time ``now`` (monotonic seconds)."""
        with self._lock:
            tokens, at = self._buckets.pop(source, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
            return allowed
