"""Per-peer health: a pure state machine driven by joins, heartbeats and ``tick(now)``.

No I/O and no clock: every method that depends on time takes ``now`` (seconds, the
coordinator's clock). Heartbeat figures come from remote peers, so they are validated here
and rejected with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Concatenate, ParamSpec, TypeVar

from protocol.errors import SwarmtrainError

logger = logging.getLogger(__name__)


RECENT_CLAIMS = 10
FLAG_OFFENCES = 3


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[HealthTracker, _P], _R]) -> Callable[Concatenate[HealthTracker, _P], _R]:
    """Run ``method`` under the tracker's lock: heartbeats update it from the gRPC threads while
    the ticker and the readers use it from theirs (``coordinator.servicer``)."""

    @functools.wraps(method)
    def locked(self: HealthTracker, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class PeerState(str, Enum):
    """Where a peer stands, as the coordinator sees it."""

    JOINING = "joining"
    TRAINING = "training"
    AVERAGING = "averaging"
    STRAGGLING = "straggling"
    UNREACHABLE = "unreachable"
    OFFLINE = "offline"


PHASES: dict[str, PeerState] = {
    "joining": PeerState.JOINING,
    "training": PeerState.TRAINING,
    "averaging": PeerState.AVERAGING,
    "leaving": PeerState.OFFLINE,
}
"""Phases a heartbeat may report, and the state each one maps to."""

_SILENT = (PeerState.UNREACHABLE, PeerState.OFFLINE)
_WORKING = ("training", "averaging")


NETWORK_PATHS = ("direct", "announced", "relayed", "client", "unknown")
"""How others reach a peer, as it said when it joined (``unknown``: it did not say)."""


def network_paths(peers: Iterable[PeerHealth]) -> dict[str, int]:
    """``peers`` counted by network path, every path named (0 where none)."""
    counts = dict.fromkeys(NETWORK_PATHS, 0)
    for peer in peers:
        path = peer.network_path or "unknown"
        counts[path] = counts.get(path, 0) + 1
    return counts


class UnknownPeerError(SwarmtrainError, ValueError):
    """A heartbeat for a key that never joined (or was removed)."""


@dataclass
class PeerHealth:
    """One peer's record. ``key`` is its public id (``ed25519:...``)."""

    key: str
    libp2p_peer_id: str
    software_version: str
    reachable: bool
    """Whether the peer said it can accept inbound connections (no NAT); not liveness."""
    joined_at: float
    last_seen: float
    """Latest time a join or heartbeat was received; never moves backwards."""
    state: PeerState
    round: int = 0
    samples_per_second: float = 0.0
    samples_total: int = 0
    loss: float | None = None
    phase: str = "joining"
    """The phase the peer last reported (one of ``PHASES``)."""
    network_path: str = ""
    """How others reach it, as it said (``coordinator.limits.NETWORK_PATHS``; "" before it knew)."""
    local_ranks: int = 1
    """Local ranks (GPUs) of the node, as it said when it joined."""
    relay: str = ""
    """``HOST:PORT`` of the relay it runs for others (the host its join came from), or ""."""
    recent_claims: deque[bool] = field(default_factory=lambda: deque(maxlen=RECENT_CLAIMS))
    """Its last decided claims, newest last: True where its group's robust averaging named it
    (the claim was denied for it)."""
    state_digest: str = ""
    """The digest of its state at ``round``, as its latest heartbeat said ("" before its first
    round)."""
    rounds_failed: int | None = None
    """Rounds whose averaging failed since the peer's process started, as its latest heartbeat
    said (None before its first heartbeat)."""
    punched_peers: int = 0
    """Peers it reached over a hole-punched connection at its latest heartbeat."""
    allreduce_s: float | None = None
    """Seconds the all-reduce of its latest recorded round report took (None before one)."""
    bytes_sent: int = 0
    """Bytes its recorded round reports said it sent in all-reduces, summed since
    ``counted_since`` (re-joins keep the sums and the failed rounds)."""
    bytes_received: int = 0
    """Bytes its recorded round reports said it received, summed like ``bytes_sent``."""
    counted_since: float = 0.0
    """When this tracker first saw the key: the start of ``bytes_sent``/``bytes_received``."""

    @property
    def offences(self) -> int:
        """Offences among its last ``RECENT_CLAIMS`` decided claims."""
        return sum(self.recent_claims)

    @property
    def flagged(self) -> bool:
        """Repeatedly named by its groups: at least ``FLAG_OFFENCES`` of its recent claims
        (what an operator looks at before a ban; nothing is done automatically)."""
        return self.offences >= FLAG_OFFENCES


@dataclass(frozen=True)
class HealthConfig:
    """Timing of liveness decisions."""

    heartbeat_interval_s: float = 5.0
    """How often peers are asked to heartbeat, in seconds."""
    unreachable_after: float = 3.0
    """Silence longer than this many intervals makes a peer UNREACHABLE."""
    offline_after: float = 12.0
    """Silence longer than this many intervals makes a peer OFFLINE."""
    straggle_rounds: int = 2
    """A working peer more than this many rounds behind the swarm is STRAGGLING."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.heartbeat_interval_s) and self.heartbeat_interval_s > 0):
            raise ValueError(f"heartbeat_interval_s must be a positive number, got {self.heartbeat_interval_s!r}")
        if not (math.isfinite(self.unreachable_after) and self.unreachable_after > 0):
            raise ValueError(f"unreachable_after must be a positive number, got {self.unreachable_after!r}")
        if not (math.isfinite(self.offline_after) and self.offline_after >= self.unreachable_after):
            raise ValueError(f"offline_after must be >= unreachable_after, got {self.offline_after!r}")
        if self.straggle_rounds < 0:
            raise ValueError(f"straggle_rounds must be >= 0, got {self.straggle_rounds!r}")

    @property
    def unreachable_s(self) -> float:
        return self.unreachable_after * self.heartbeat_interval_s

    @property
    def offline_s(self) -> float:
        return self.offline_after * self.heartbeat_interval_s


@dataclass(frozen=True)
class SwarmSummary:
    """Swarm-wide figures at one instant."""

    peers_online: int
    """Peers neither OFFLINE nor UNREACHABLE (nor silent past the unreachable limit)."""
    samples_per_second: float
    """Sum of the online peers' reported throughput."""
    swarm_round: int
    """Highest round reported by a peer that is not OFFLINE; 0 when there is none."""


Transition = tuple[str, PeerState, PeerState]


class HealthTracker:
    """Tracks every admitted peer's liveness and progress.

    States: JOINING, TRAINING, AVERAGING, STRAGGLING, UNREACHABLE, OFFLINE.

    Transitions (``interval`` = ``heartbeat_interval_s``, ``silence`` = now - last_seen):
    - ``join`` (new key, or any state of a known key) -> JOINING; the record starts afresh.
    - ``heartbeat`` with phase ``joining``/``training``/``averaging`` -> JOINING/TRAINING/
      AVERAGING, from any state (a heartbeat revives an UNREACHABLE or OFFLINE peer), except
      that a training/averaging peer still behind the swarm goes to (or stays) STRAGGLING.
    - ``heartbeat`` with phase ``leaving`` -> OFFLINE at once.
    - ``tick``: any state but OFFLINE with silence > ``offline_after * interval`` -> OFFLINE;
      JOINING/TRAINING/AVERAGING/STRAGGLING with silence > ``unreachable_after * interval``
      -> UNREACHABLE.
    - ``tick``: TRAINING/AVERAGING whose round < swarm_round - ``straggle_rounds`` ->
      STRAGGLING; STRAGGLING that caught up -> the phase of its last heartbeat.
      ``swarm_round`` = max round over peers not OFFLINE. JOINING peers never straggle.
    - ``remove`` (a ban) forgets the peer; its heartbeats then raise ``UnknownPeerError``.
    """

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._peers: dict[str, PeerHealth] = {}
        self._swarm_round_cache: int | None = None
        self._rounds_failed_total = 0

    @_locked
    def join(
        self,
        key: str,
        *,
        libp2p_peer_id: str,
        software_version: str,
        reachable: bool,
        now: float,
        local_ranks: int = 1,
        network_path: str = "",
        relay: str = "",
    ) -> PeerHealth:
        """Record a (re-)join: the peer starts over in JOINING."""
        _check_time(now)
        peer = PeerHealth(
            key=key,
            libp2p_peer_id=libp2p_peer_id,
            software_version=software_version,
            reachable=bool(reachable),
            network_path=network_path,
            relay=relay,
            joined_at=now,
            last_seen=now,
            state=PeerState.JOINING,
            local_ranks=local_ranks,
        )
        old = self._peers.get(key)
        peer.counted_since = now
        if old is not None:
            peer.last_seen = max(now, old.last_seen)
            # the same key's traffic and failures go on counting (a token renewal re-joins)
            peer.counted_since, peer.rounds_failed = old.counted_since, old.rounds_failed
            peer.bytes_sent, peer.bytes_received, peer.allreduce_s = old.bytes_sent, old.bytes_received, old.allreduce_s
        self._peers[key] = peer
        self._swarm_round_cache = None
        logger.info("peer %s joined (%s)", key, "re-join" if old is not None else "new")
        return peer

    @_locked
    def heartbeat(
        self,
        key: str,
        *,
        now: float,
        round: int,
        phase: str,
        samples_per_second: float,
        samples_total: int,
        loss: float | None,
        state_digest: str = "",
        rounds_failed: int | None = None,
        punched_peers: int = 0,
    ) -> PeerHealth:
        """Apply a heartbeat's figures and phase; ``UnknownPeerError`` for an unknown key,
        ``ValueError`` naming the field for a malformed value (nothing is changed then).

        ``rounds_failed`` is the peer's own running count (None: not said, kept as it was).
        The swarm's total (``rounds_failed_total``) grows by what it rose since the key's
        previous heartbeat, or by all of it when it fell (the peer restarted); a key's first
        heartbeat only sets where its count starts (after a coordinator restart, the rounds a
        peer failed before are not counted again)."""
        _check_time(now)
        _check_heartbeat(round, phase, samples_per_second, samples_total, loss, state_digest, rounds_failed)
        if not _is_int(punched_peers) or punched_peers < 0:
            raise ValueError(f"heartbeat punched_peers must be a non-negative integer, got {punched_peers!r}")
        peer = self._peers.get(key)
        if peer is None:
            raise UnknownPeerError(f"heartbeat from unknown peer {key!r}: join first")
        if rounds_failed is not None:
            previous = peer.rounds_failed
            if previous is not None:
                self._rounds_failed_total += rounds_failed - previous if rounds_failed >= previous else rounds_failed
            peer.rounds_failed = int(rounds_failed)
        peer.last_seen = max(peer.last_seen, now)
        peer.punched_peers = int(punched_peers)
        peer.round, peer.phase, peer.loss, peer.state_digest = int(round), phase, loss, state_digest
        peer.samples_per_second, peer.samples_total = float(samples_per_second), int(samples_total)
        swarm_round = max(self._swarm_round(), peer.round)
        self._swarm_round_cache = swarm_round
        self._set(peer, self._target_state(peer, swarm_round))
        if peer.state == PeerState.OFFLINE:  # left: its round no longer counts
            self._swarm_round_cache = None
        return peer

    @_locked
    def tick(self, now: float) -> list[Transition]:
        """Apply time-based transitions and straggler checks; return (key, old, new) for each."""
        _check_time(now)
        changes: list[Transition] = []
        for peer in self._sorted():
            silence = now - peer.last_seen
            if peer.state != PeerState.OFFLINE and silence > self.config.offline_s:
                changes.append(self._set(peer, PeerState.OFFLINE))
            elif peer.state not in _SILENT and silence > self.config.unreachable_s:
                changes.append(self._set(peer, PeerState.UNREACHABLE))
        self._swarm_round_cache = None
        swarm_round = self._swarm_round()
        for peer in self._sorted():
            if peer.state not in _SILENT:
                changes.append(self._set(peer, self._target_state(peer, swarm_round)))
        return [c for c in changes if c[1] != c[2]]

    @_locked
    def record_report(self, key: str, *, allreduce_s: float, bytes_sent: int, bytes_received: int) -> None:
        """A round report of ``key`` was recorded: keep its all-reduce time, add its bytes
        (``ValueError`` naming the field for a malformed value, nothing changed then; an
        unknown key is a no-op)."""
        if not _is_number(allreduce_s) or not math.isfinite(allreduce_s) or allreduce_s < 0:
            raise ValueError(f"round report allreduce_s must be finite and >= 0, got {allreduce_s!r}")
        for name, value in (("bytes_sent", bytes_sent), ("bytes_received", bytes_received)):
            if not _is_int(value) or value < 0:
                raise ValueError(f"round report {name} must be a non-negative integer, got {value!r}")
        peer = self._peers.get(key)
        if peer is not None:
            peer.allreduce_s = float(allreduce_s)
            peer.bytes_sent += bytes_sent
            peer.bytes_received += bytes_received

    @_locked
    def rounds_failed_total(self) -> int:
        """Rounds the peers said failed since this tracker started (see ``heartbeat``)."""
        return self._rounds_failed_total

    @_locked
    def record_claim(self, key: str, *, offence: bool) -> None:
        """A claim of ``key`` was decided; ``offence``: denied because its group named it."""
        peer = self._peers.get(key)
        if peer is not None:
            peer.recent_claims.append(offence)

    @_locked
    def flagged(self) -> int:
        """How many tracked peers are ``flagged``."""
        return sum(1 for p in self._peers.values() if p.flagged)

    @_locked
    def remove(self, key: str) -> None:
        """Forget a peer (e.g. banned); a no-op for an unknown key."""
        if self._peers.pop(key, None) is not None:
            self._swarm_round_cache = None
            logger.info("peer %s removed", key)

    @_locked
    def peers(self) -> list[PeerHealth]:
        """Every known peer, sorted by key."""
        return self._sorted()

    @_locked
    def get(self, key: str) -> PeerHealth | None:
        return self._peers.get(key)

    @_locked
    def online(self, now: float) -> list[PeerHealth]:
        """Copies of the peers online at ``now`` (as ``summary`` counts them), sorted by key:
        each one whole as of one moment, whatever heartbeats arrive meanwhile."""
        _check_time(now)
        return [copy.copy(p) for p in self._sorted() if self._online(p, now)]

    @_locked
    def relays(self, now: float, *, exclude: str = "") -> list[str]:
        """The relays (``HOST:PORT``) of the peers online at ``now`` that run one, but
        ``exclude``'s, sorted by peer key."""
        return [relay for _key, relay in self.relay_offers(now, exclude=exclude)]

    @_locked
    def relay_offers(self, now: float, *, exclude: str = "") -> list[tuple[str, str]]:
        """(peer key, ``HOST:PORT``) of each relay ``relays`` returns."""
        _check_time(now)
        return [(p.key, p.relay) for p in self._sorted() if p.relay and p.key != exclude and self._online(p, now)]

    @_locked
    def summary(self, now: float) -> SwarmSummary:
        """Figures as of ``now``; a peer silent past the unreachable limit counts as not
        online even before the next ``tick`` records it. Changes nothing."""
        _check_time(now)
        online = [p for p in self._peers.values() if self._online(p, now)]
        return SwarmSummary(
            peers_online=len(online),
            samples_per_second=sum(p.samples_per_second for p in online),
            swarm_round=self._swarm_round(),
        )

    # --- helpers ------------------------------------------------------------------------------

    def _sorted(self) -> list[PeerHealth]:
        return [self._peers[k] for k in sorted(self._peers)]

    def _online(self, peer: PeerHealth, now: float) -> bool:
        return peer.state not in _SILENT and now - peer.last_seen <= self.config.unreachable_s

    def _swarm_round(self) -> int:
        """The highest round a live peer is at: recomputed at each tick, join and removal, and
        raised by heartbeats in between (a heartbeat must not scan every peer: thousands of
        peers send hundreds of heartbeats a second)."""
        if self._swarm_round_cache is None:
            self._swarm_round_cache = max(
                (p.round for p in self._peers.values() if p.state != PeerState.OFFLINE), default=0
            )
        return self._swarm_round_cache

    def _target_state(self, peer: PeerHealth, swarm_round: int) -> PeerState:
        """The state a live peer should be in, given its last phase and the swarm's round."""
        if peer.phase in _WORKING and peer.round < swarm_round - self.config.straggle_rounds:
            return PeerState.STRAGGLING
        return PHASES[peer.phase]

    def _set(self, peer: PeerHealth, state: PeerState) -> Transition:
        old = peer.state
        if old != state:
            peer.state = state
            logger.info("peer %s: %s -> %s", peer.key, old.value, state.value)
        return (peer.key, old, state)


def _check_time(now: float) -> None:
    if not isinstance(now, (int, float)) or isinstance(now, bool) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {now!r}")


def _check_heartbeat(
    round: int,
    phase: str,
    samples_per_second: float,
    samples_total: int,
    loss: float | None,
    state_digest: str = "",
    rounds_failed: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first malformed field of a heartbeat."""
    if not _is_int(round) or round < 0:
        raise ValueError(f"heartbeat round must be a non-negative integer, got {round!r}")
    if not isinstance(phase, str) or phase not in PHASES:
        raise ValueError(f"heartbeat phase must be one of {sorted(PHASES)}, got {phase!r}")
    if not _is_number(samples_per_second) or not math.isfinite(samples_per_second) or samples_per_second < 0:
        raise ValueError(f"heartbeat samples_per_second must be finite and >= 0, got {samples_per_second!r}")
    if not _is_int(samples_total) or samples_total < 0:
        raise ValueError(f"heartbeat samples_total must be a non-negative integer, got {samples_total!r}")
    if loss is not None and (not _is_number(loss) or not math.isfinite(loss)):
        raise ValueError(f"heartbeat loss must be finite or absent, got {loss!r}")
    if not isinstance(state_digest, str):
        raise ValueError(f"heartbeat state_digest must be a string, got {state_digest!r}")
    if rounds_failed is not None and (not _is_int(rounds_failed) or rounds_failed < 0):
        raise ValueError(f"heartbeat rounds_failed must be a non-negative integer, got {rounds_failed!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
