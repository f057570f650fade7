"""The data streams of a token run, handed out to peers (``peer.task.data_assignment``).

A run has ``data.slots`` streams; in each round stream k trains the k-th page of the data and
no other stream does, so the coordinator must never give one stream to two live peers. A
node of W local ranks holds W consecutive streams (one per rank). A peer keeps its streams
while it is seen (joins, heartbeats) and for ``lease_s`` after; a restarted peer gets the
same ones back by its key. Assignments are in the database (a restarted coordinator hands
out the same streams); when it starts, every holder is taken as just seen, so nobody loses
its streams to a newcomer while the swarm reconnects.
"""

from __future__ import annotations

import logging
import threading

from coordinator.store import Store
from protocol.errors import AdmissionError

logger = logging.getLogger(__name__)

LEASE_S = 300.0
"""How long a peer that stopped heartbeating keeps its data streams."""


class DataSlots:
    """Who holds which of the run's ``slots`` data streams."""

    def __init__(self, store: Store, slots: int, *, now: float, lease_s: float = LEASE_S) -> None:
        self.store, self.slots, self.lease_s = store, slots, lease_s
        self._holder: dict[int, str] = store.data_slots()
        self._held: dict[str, list[int]] = {}
        """Each holder's streams, in order (``_holder`` the other way round: a heartbeat asks)."""
        for slot, holder in sorted(self._holder.items()):
            self._held.setdefault(holder, []).append(slot)
        self._seen: dict[str, float] = dict.fromkeys(self._holder.values(), now)
        self._changed: set[str] = set()
        """Keys whose streams changed since ``take_changed`` (their heartbeats' answers change)."""
        self._lock = threading.Lock()
        """Heartbeats mark peers seen from the servicer's threads, beside joins."""

    def assign(self, key: str, ranks: int, *, now: float) -> int:
        """The first of the ``ranks`` consecutive streams ``key`` holds: the ones it held (if
        still the same count), else the lowest free run of them. A peer whose lease ran out
        loses *all* its streams to the newcomer that needs one of them (a node never keeps
        half). Raises ``AdmissionError`` when no such run is free."""
        with self._lock:
            self._seen[key] = now
            held = self._held.get(key, [])
            if len(held) == ranks and held == list(range(held[0], held[0] + ranks)):
                return held[0]
            start = self._free_run(key, ranks, now)
            if start is None:
                raise AdmissionError(
                    f"all {self.slots} data streams of this run are held by live peers (data.slots); "
                    "try again later, or the operator raises data.slots"
                )
            taken = list(range(start, start + ranks))
            evicted = tuple(sorted({self._holder[slot] for slot in taken if self._holder.get(slot, key) != key}))
            self.store.assign_data_slots(peer_key=key, slots=taken, now=now, evicted=evicted)
            for previous in evicted:
                logger.info("data streams of %s (not seen for %.0f s) pass to %s", previous, self.lease_s, key)
                self._drop(previous)
            self._drop(key)
            for slot in taken:
                self._holder[slot] = key
            self._held[key] = taken
            self._changed.add(key)
            self._seen[key] = now
            return start

    def release(self, key: str) -> None:
        """``key`` left: its streams are free now (in the database too)."""
        with self._lock:
            if key not in self._held:
                return
            self._drop(key)
        self.store.release_data_slots(key)

    def _drop(self, key: str) -> None:
        for slot in self._held.pop(key, []):
            del self._holder[slot]
        self._seen.pop(key, None)
        self._changed.add(key)

    def seen(self, key: str, now: float) -> None:
        """``key`` is alive (a heartbeat): its streams stay its own."""
        with self._lock:
            if key in self._seen:
                self._seen[key] = now

    def held_by(self, key: str) -> list[int]:
        """The streams ``key`` holds, in order."""
        with self._lock:
            return list(self._held.get(key, ()))

    def take_changed(self) -> set[str]:
        """Keys whose streams changed since the last call (and forget them)."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed

    def holders(self) -> set[str]:
        """Peers holding streams and seen within the lease (as of their last sign of life)."""
        with self._lock:
            latest = max(self._seen.values(), default=0.0)
            return {key for key in self._holder.values() if latest - self._seen.get(key, -float("inf")) <= self.lease_s}

    def _free_run(self, key: str, ranks: int, now: float) -> int | None:
        def free(slot: int) -> bool:
            holder = self._holder.get(slot)
            return holder is None or holder == key or now - self._seen.get(holder, -float("inf")) > self.lease_s

        for start in range(self.slots - ranks + 1):
            if all(free(slot) for slot in range(start, start + ranks)):
                return start
        return None
