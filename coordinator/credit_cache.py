"""Each peer's credit as its heartbeat answers it: read from the store once, then moved by every
change the core commits (``moved``). Heartbeats run beside the core's other calls (outside its
lock), so a figure read from the store is kept only if no change to that peer's credit came in
between (a version per peer: with one version for the whole swarm, a swarm of thousands, whose
reports and decisions move some credit every few milliseconds, kept almost nothing, and nearly
every heartbeat read the database)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from coordinator.store import PeerCredit


class CreditCache:
    """Thread-safe: ``get`` from any thread, ``moved``/``forget`` from the core's."""

    def __init__(self) -> None:
        self._cache: dict[str, PeerCredit] = {}
        self._versions: dict[str, int] = {}
        """Counts each peer's credit changes: a reader caches what it read only if that peer's
        credit did not change meanwhile."""
        self._generation = 0
        """Counts ``forget()`` of everyone: a figure read before it is not kept."""
        self._changed: set[str] | None = set()
        """Keys whose credit changed since ``take_changed`` (None: everyone's may have)."""
        self._lock = threading.Lock()
        """Makes a reader's "nothing changed, cache it" one step against ``moved``."""

    def get(self, key: str, read: Callable[[str], PeerCredit]) -> PeerCredit:
        """``key``'s credit: cached, else ``read`` from the store (and cached if nothing moved meanwhile)."""
        credit = self._cache.get(key)
        if credit is None:
            with self._lock:
                seen = (self._generation, self._versions.get(key, 0))
            credit = read(key)
            with self._lock:
                if seen == (self._generation, self._versions.get(key, 0)):  # unchanged while read: keep it
                    self._cache[key] = credit
        return credit

    def moved(self, key: str, *, pending: int = 0, samples: int = 0, flops: float = 0.0) -> None:
        """The core committed a change to ``key``'s credit: move its cached figures by as much
        (a new record: a heartbeat reading the old one beside this sees a whole one)."""
        with self._lock:
            self._versions[key] = self._versions.get(key, 0) + 1
            if self._changed is not None:
                self._changed.add(key)
            cached = self._cache.get(key)
            if cached is not None:
                self._cache[key] = PeerCredit(
                    samples=cached.samples + samples,
                    flops=cached.flops + flops,
                    pending_samples=cached.pending_samples + pending,
                )

    def forget(self, key: str | None = None) -> None:
        """Forget the cached credit of ``key`` (of everyone: None)."""
        with self._lock:
            if key is None:
                self._generation += 1
                self._cache.clear()
                self._changed = None
            else:
                self._versions[key] = self._versions.get(key, 0) + 1
                self._cache.pop(key, None)
                if self._changed is not None:
                    self._changed.add(key)

    def take_changed(self) -> set[str] | None:
        """Keys whose credit changed since the last call (None: anyone's may have), and forget them."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed
