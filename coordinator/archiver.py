"""The coordinator's archive service: fetch the swarm's state every K rounds, keep it, serve it.

A thread polls every few seconds. When the swarm is ``every`` rounds past the last archived
round (by the coordinator's finalized rounds and the peers' signed digest records), it
downloads the current global state from a peer through an ``ExactAverager`` of the run
(bytes checked against the digest the peer claims). Peers serve only their latest state,
often of a round not yet confirmed, so the state is held until its round is: it is kept
only if its digest is the one the coordinator finalized from the group's reports for that
round (or, for peers that do not report, the one a strict majority of the admitted peers'
records hold: ``protocol.agreement``); otherwise, or if the round is never confirmed, it is dropped. The state is written to the ``CheckpointArchive`` and served to newcomers:
the averager shares it like a peer does, and the coordinator publishes a signed digest
record for it marked ``archive`` (re-signed before it expires), so a newcomer that finds no
peer serving the latest state falls back to it (``Trainer.catch_up``).

The archive averager never takes part in matchmaking; it only serves and downloads state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from coordinator.archive import ArchivedState, CheckpointArchive, LoadedState
from coordinator.store import RoundRow
from engine.records import RunRecords
from protocol.agreement import agreed_state
from protocol.identity import Identity
from protocol.membership import MemberGate
from protocol.statesync import RECORD_TTL_S, DigestRecord, record_votes, state_digest
from protocol.tokens import issue_token

logger = logging.getLogger(__name__)

POLL_S = 2.0
STOP_JOIN_S = 5.0
"""How long ``stop`` waits for the loop's thread once the averager is down."""
MAX_BACKOFF_S = 60.0
REPUBLISH_S = RECORD_TTL_S / 4


class Archiver:
    """Runs beside the coordinator; ``finalized`` returns the finalized rounds (newest first)."""

    def __init__(
        self,
        *,
        averager: Any,
        dht: Any,
        identity: Identity,
        archive: CheckpointArchive,
        every: int,
        finalized: Callable[[], list[RoundRow]],
        fetch_timeout_s: float,
        run_digest: str,
        token_ttl_s: float,
        gate: MemberGate,
    ) -> None:
        self.averager, self.dht, self.identity, self.archive = averager, dht, identity, archive
        self.gate = gate
        """Whose digest records count: the peers holding this coordinator's valid tokens."""
        self.run_digest, self.token_ttl_s = run_digest, token_ttl_s
        self._token_renew_at = -float("inf")
        self.every, self.finalized, self.fetch_timeout_s = every, finalized, fetch_timeout_s
        self.records = RunRecords(dht, averager.prefix)
        self.serving: LoadedState | None = None
        self.last_error = ""
        self._published_at = -float("inf")
        self._candidate: LoadedState | None = None
        self._candidate_since = 0.0
        self.confirm_timeout_s = max(120.0, 4 * fetch_timeout_s)
        """How long a fetched state waits for its round to be confirmed."""
        self._next_fetch_at = 0.0
        self._backoff_s = POLL_S
        self._stop = threading.Event()
        self._saving = threading.Lock()
        """Held while a checkpoint is written: ``stop`` waits for it, never for a download."""
        self._thread = threading.Thread(target=self._loop, name="archiver", daemon=True)
        averager.allow_state_sharing = False
        averager.state_provider = self._provide

    def start(self) -> None:
        self._publish_membership(wait=True)  # peers download from and serve to admitted peers only
        loaded = self.archive.load_latest()
        if loaded is not None:
            self._serve(loaded)
            self._publish(get_dht_time(), wait=True)  # before any peer can join and look for state
            logger.info("archive: serving round %d (%s) from disk", loaded.round, loaded.state_digest[:19])
        self._thread.start()

    def stop(self) -> None:
        """Stop in seconds: a checkpoint being written is finished (up to ``SAVE_GRACE_S``), a
        download is not waited for (it took up to 4 fetch timeouts: one stop took 144 s); the
        averager goes first, which ends the download, and the loop's thread is a daemon."""
        self._stop.set()
        with self._saving:  # never mid-write: a half-written checkpoint is a temp file anyway, but
            pass  # the newest verified state should reach the disk when it is that close
        if self.averager.is_alive():
            self.averager.shutdown()
        self._thread.join(timeout=STOP_JOIN_S)

    def checkpoints(self) -> list[ArchivedState]:
        return self.archive.list()

    # --- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll(now=get_dht_time())
            except Exception:
                if self._stop.is_set():  # the averager went down under a pass: the coordinator stops
                    logger.debug("archive pass ended by the stop", exc_info=True)
                    return
                logger.exception("archive pass failed")

    def poll(self, *, now: float) -> ArchivedState | None:
        """One pass: re-publish our record when due; fetch a state when due; keep a fetched
        state once the swarm's agreement on its round confirms its digest."""
        if time.time() >= self._token_renew_at:
            self._publish_membership()
        if self.serving is not None and now - self._published_at >= REPUBLISH_S:
            self._publish(now)
        last = self.serving.round if self.serving is not None else 0
        if self._candidate is not None:
            return self._confirm(now)
        if now < self._next_fetch_at or self._swarm_round(after=last) < last + self.every:
            return None
        # peers serve only their latest state, which may be a round newer than anything the
        # swarm has confirmed yet: take it now, keep it once its round is confirmed
        fetched = self.averager.load_verified_state(None, timeout=self.fetch_timeout_s)
        if fetched is None or fetched[0] <= last:
            self._backoff_s = min(MAX_BACKOFF_S, self._backoff_s * 2)
            self._next_fetch_at = now + self._backoff_s
            self.last_error = f"no peer served a state newer than round {last}"
            logger.info("archive: %s; next try in %.0f s", self.last_error, self._backoff_s)
            return None
        self._backoff_s = POLL_S
        round_, params, momentum = fetched
        self._candidate = LoadedState(round_, params, momentum, state_digest(round_, params, momentum))
        self._candidate_since = now
        return self._confirm(now)

    def _confirm(self, now: float) -> ArchivedState | None:
        candidate = self._candidate
        assert candidate is not None
        agreed = self._agreed_digest(candidate.round)
        if agreed is None:
            if now - self._candidate_since > self.confirm_timeout_s:
                self.last_error = f"round {candidate.round} was never confirmed; dropped the state fetched for it"
                logger.warning("archive: %s", self.last_error)
                self._candidate = None
            return None
        self._candidate = None
        if agreed != candidate.state_digest:
            self.last_error = (
                f"a peer served round {candidate.round} as {candidate.state_digest[:19]}..., not the swarm's"
            )
            logger.warning("archive: %s", self.last_error)
            return None
        with self._saving:
            entry = self.archive.save(candidate.round, candidate.params, candidate.momentum, now=now)
        self._serve(candidate)
        self._publish(now)
        self.last_error = ""
        logger.info("archive: kept round %d (%s, %d bytes)", entry.round, entry.state_digest[:19], entry.size_bytes)
        return entry

    def _agreed_digest(self, round_: int) -> str | None:
        """The digest the swarm agreed on for ``round_`` (``protocol.agreement``): the one the
        coordinator finalized from the group's reports, else the one a strict majority of the
        admitted peers' records of that round hold. Records of keys without a valid token of
        this coordinator do not count."""
        for row in self.finalized():
            if row.round == round_:
                return row.state_digest or None  # "": the reports tied
        agreed = agreed_state(record_votes([r for r in self._records() if r.round == round_]))
        return agreed.digest if agreed is not None else None

    def _swarm_round(self, *, after: int) -> int:
        """The newest round the swarm reached, by finalized rounds and the peers' records."""
        finalized = [row.round for row in self.finalized()[:1]]
        published = [r.round for r in self._records()]
        return max([after, *finalized, *published])

    def _records(self) -> list[DigestRecord]:
        """The admitted peers' digest records (only members vote: ``protocol.agreement``)."""
        records = self.records.digest_records()
        if not records:
            return []
        self.gate.refresh(self.dht)
        now = time.time()
        return [r for r in records if not r.archive and self.gate.is_member_key(r.signer.id, now=now)]

    def _serve(self, state: LoadedState) -> None:
        self.serving = state
        self.averager.allow_state_sharing = True

    def _provide(self, take: Callable[[int, Any, Any, str], dict[str, Any]]) -> dict[str, Any]:
        state = self.serving
        if state is None:
            raise RuntimeError("the archive has no state yet")
        return take(state.round, state.params, state.momentum, state.state_digest)

    def _publish_membership(self, *, wait: bool = False) -> None:
        """Admit our own averager like a peer: a token for its libp2p peer id, in the DHT."""
        now, peer_id = time.time(), str(self.dht.peer_id)
        token = issue_token(
            self.identity,
            run_digest=self.run_digest,
            peer_key=self.identity.public_key,
            now=now,
            ttl_s=self.token_ttl_s,
            libp2p_peer_id=peer_id,
        )
        self.records.publish_token(
            token.to_bytes(), libp2p_peer_id=peer_id, expires_at=token.expires_at, timeout_s=30.0 if wait else None
        )
        self._token_renew_at = now + self.token_ttl_s / 2

    def _publish(self, now: float, *, wait: bool = False) -> None:
        state = self.serving
        if state is None:
            return
        self.records.publish_digest(
            self.identity, round_=state.round, digest=state.state_digest, archive=True, wait=wait
        )
        self._published_at = now
