"""Heartbeats in the core: applying one (from the main port, or in batches from the heartbeat
processes, ``coordinator.front``) and the answers those processes give.

A heartbeat's figures go to the health tracker (and, in a token run, keep the peer's data
streams); its answer says whether the peer is admitted, its credit and its data stream. The
main port answers from here directly. A heartbeat process answers from its own table, which
this keeps current: ``drain`` returns the answers of the keys that joined, whose credit or
streams changed, and the keys no longer admitted since the last call (the server sends them
each tick, and at once after a join, so that a peer's first heartbeat finds itself admitted).
Thread-safe, like everything heartbeats touch: the servicer calls it outside its lock.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from coordinator.credit_cache import CreditCache
from coordinator.front.wire import Answer, Beat
from coordinator.health import HealthTracker
from coordinator.slots import DataSlots
from coordinator.store import Store
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import VerificationError
from protocol.identity import PublicKey
from protocol.messages import MessageVerifier

logger = logging.getLogger(__name__)

PHASES = {
    pb.PEER_PHASE_JOINING: "joining",
    pb.PEER_PHASE_TRAINING: "training",
    pb.PEER_PHASE_AVERAGING: "averaging",
    pb.PEER_PHASE_LEAVING: "leaving",
}


class Heartbeats:
    """The core's heartbeat side (see the module doc)."""

    def __init__(
        self,
        *,
        health: HealthTracker,
        credit: CreditCache,
        store: Store,
        verifier: MessageVerifier,
        admitted: Callable[[PublicKey], bool],
        max_samples_per_second: float,
        data_slots: DataSlots | None = None,
    ) -> None:
        self.health, self.credit, self.store, self.verifier = health, credit, store, verifier
        self.admitted, self.data_slots = admitted, data_slots
        self.max_samples_per_second = max_samples_per_second
        self._joined: set[str] = set()
        self._dropped: set[str] = set()
        self._signed_at: dict[str, float] = {}
        """Key -> the signing time of its latest heartbeat applied."""
        self._lock = threading.Lock()

    def newer(self, key: str, signed_at: float) -> bool:
        """Whether a heartbeat ``key`` signed at ``signed_at`` is not older than the last one
        applied (then it counts as the last): a beat that waited in a heartbeat process's queue
        while its peer sent a fresh one over gRPC must not set the peer's figures back."""
        with self._lock:
            if signed_at < self._signed_at.get(key, -math.inf):
                return False
            self._signed_at[key] = signed_at
            return True

    def apply(self, key: str, body: pb.HeartbeatBody, now: float) -> None:
        """Apply an admitted peer's verified, in-bounds heartbeat ``body`` received at ``now``;
        ``ValueError`` for a value the health tracker refuses (nothing changed then)."""
        self.health.heartbeat(
            key,
            now=now,
            round=body.round,
            phase=PHASES.get(body.phase, "training"),
            # no peer counts for more than the run's plausibility cap in the swarm's figures
            samples_per_second=min(body.samples_per_second, self.max_samples_per_second),
            samples_total=body.samples_total,
            loss=body.loss if math.isfinite(body.loss) else None,
            state_digest=body.state_digest,
            rounds_failed=body.rounds_failed,
            punched_peers=body.punched_peers,
        )
        if self.data_slots is not None:
            if body.phase == pb.PEER_PHASE_LEAVING:
                self.data_slots.release(key)
            else:
                self.data_slots.seen(key, now)

    def apply_beats(self, beats: tuple[Beat, ...], *, now: float) -> int:
        """Apply a heartbeat process's batch: each beat of a key still admitted, recorded once
        against replays (a beat replayed to a second process is applied once), signed no earlier
        than the last one applied (``newer``), at the time it was received (never later than
        ``now``). The number applied."""
        applied = 0
        for beat in beats:
            try:
                peer = PublicKey(beat.signer)
                if peer.id != beat.key or not self.admitted(peer):
                    continue
                self.verifier.record_nonce(beat.signer, beat.nonce, beat.timestamp, now=now, what=kinds.HEARTBEAT)
                body = pb.HeartbeatBody.FromString(beat.body)
                if not self.newer(beat.key, beat.timestamp):
                    logger.debug("a heartbeat of %s signed before one already applied: not applied", beat.key)
                    continue
                self.apply(beat.key, body, min(beat.received_at, now))
            except (VerificationError, ValueError, RuntimeWarning) as exc:  # not taken: the rest are
                logger.info("a heartbeat process's beat of %s not applied: %s", beat.key, exc)
                continue
            applied += 1
        return applied

    def response(self, key: str, now: float, interval_s: float) -> pb.HeartbeatResponse:
        """The answer to an admitted peer's heartbeat (credit from the cache; without it, while
        the database is away)."""
        response = pb.HeartbeatResponse(server_time=now, heartbeat_interval_s=interval_s, admitted=True)
        self.answer(key).fill(response)
        return response

    def answer(self, key: str) -> Answer:
        """What ``key``'s heartbeats are answered with now."""
        held = self.data_slots.held_by(key) if self.data_slots is not None else []
        figures: tuple[int, float, int] | None = None
        try:
            credit = self.credit.get(key, self.store.credit_of)
            figures = (credit.samples, credit.flops, credit.pending_samples)
        except SQLAlchemyError as exc:  # heartbeats keep health going while the database is away
            logger.warning("could not read %s's credit for its heartbeat: %s", key, exc)
        return Answer(credit=figures, data_slot=held[0] if held else None)

    # --- what the heartbeat processes answer ---------------------------------------------

    def joined(self, key: str) -> None:
        """``key`` was admitted (again)."""
        with self._lock:
            self._joined.add(key)
            self._dropped.discard(key)
            self._signed_at.pop(key, None)  # a peer restarted with its clock set back starts afresh

    def dropped(self, key: str) -> None:
        """``key`` is no longer admitted (banned, taken off the allowlist)."""
        with self._lock:
            self._dropped.add(key)
            self._joined.discard(key)
            self._signed_at.pop(key, None)

    def drain(self) -> tuple[dict[str, Answer], tuple[str, ...]]:
        """The answers that changed since the last call (keys that joined, whose credit or data
        streams moved; every admitted key's when anyone's may have) and the keys dropped."""
        with self._lock:
            joined, dropped = self._joined, self._dropped
            self._joined, self._dropped = set(), set()
        credit = self.credit.take_changed()
        slots = self.data_slots.take_changed() if self.data_slots is not None else set()
        changed = {p.key for p in self.health.peers()} if credit is None else joined | credit | slots
        answers = {}
        for key in changed - dropped:
            if self.health.get(key) is not None:
                answers[key] = answer = self.answer(key)
                if answer.credit is None:  # the database is away: again at the next drain
                    with self._lock:
                        self._joined.add(key)
        return answers, tuple(sorted(dropped))

    def everyone(self) -> dict[str, Answer]:
        """Every admitted key's answer (a heartbeat process started afresh)."""
        return {p.key: self.answer(p.key) for p in self.health.peers()}
