"""The run's records in its DHT, written and read the same way by peers and the coordinator.

Keys (``prefix`` is ``statesync.run_prefix(spec digest)``; one subkey per writer):

- ``{prefix}.digests``: each peer's signed state digest after a round (``statesync``), subkey
  its node public id; the coordinator's archive publishes one marked ``archive``.
- ``{prefix}.members``: each admitted peer's access token (``tokens``), subkey the libp2p peer
  id the token is bound to; expires with the token.
- ``{prefix}.revoked``: the coordinator's signed revocation list (``membership``), subkey the
  coordinator's public id.

hivemind's own keys under the same prefix (matchmaking, ``.all_averagers`` for state
sharing) are written by its averager. The DHT stores anything anyone sends: readers verify
every value (signature, signer, subkey, age) and count only members' votes
(``protocol.agreement``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from protocol.identity import Identity
from protocol.membership import members_key, revocations_key
from protocol.statesync import RECORD_TTL_S, DigestRecord, collect_records, digest_key, make_digest_record

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 30.0


class RunRecords:
    """Read and write one run's records through a hivemind ``DHT`` (from the host process)."""

    def __init__(self, dht: Any, prefix: str) -> None:
        self.dht, self.prefix = dht, prefix
        self.digest_key = digest_key(prefix)

    def publish_digest(
        self,
        identity: Identity,
        *,
        round_: int,
        digest: str,
        archive: bool = False,
        roster: int = 0,
        leaving: bool = False,
        wait: bool = False,
        landed: float | None = None,
    ) -> None:
        """Sign and store ``identity``'s state digest after ``round_`` (with the state's roster
        size as it knows it, ``protocol.roster``, whether it is leaving, and when it landed the
        state by averaging, ``landed``; waits only if ``wait``)."""
        now = get_dht_time()
        record = make_digest_record(
            identity,
            round_=round_,
            digest=digest,
            now=now,
            archive=archive,
            roster=roster,
            leaving=leaving,
            landed=None if landed is None else min(landed, now),
        )
        future = self.dht.store(
            self.digest_key, record, now + RECORD_TTL_S, subkey=identity.public_key.id, return_future=True
        )
        if wait:
            future.result(timeout=STORE_TIMEOUT_S)

    def digest_records(self) -> list[DigestRecord]:
        """Every digest record in the DHT that verifies (invalid ones are logged and dropped)."""
        return self.start_digest_records()()

    def start_digest_records(self) -> Callable[[], list[DigestRecord]]:
        """``digest_records`` begun: the lookup runs in the DHT's process while the caller does
        something else; the returned call waits for it and verifies what it found."""
        future = self.dht.get(self.digest_key, latest=True, return_future=True)

        def finish() -> list[DigestRecord]:
            found = future.result()
            if found is None or not isinstance(found.value, dict):
                return []
            return collect_records(found.value, now=get_dht_time())

        return finish

    def publish_token(self, token: bytes, *, libp2p_peer_id: str, expires_at: float, timeout_s: float | None) -> bool:
        """Store an access token under the peer id it is bound to, until it expires. With
        ``timeout_s``, wait that long for the DHT and say whether it stored it (logged if not)."""
        future = self.dht.store(members_key(self.prefix), token, expires_at, subkey=libp2p_peer_id, return_future=True)
        if timeout_s is None:
            return True
        try:
            stored = bool(future.result(timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - a DHT hiccup: peers will look again later
            logger.warning("could not publish an access token in the DHT: %s", exc)
            return False
        if not stored:
            logger.warning("the DHT did not store an access token; other peers may refuse its peer")
        return stored

    def publish_revocations(self, coordinator: Identity, record: bytes, *, expires_at: float, wait: bool) -> None:
        """Store the coordinator's signed revocation list (``membership.make_revocations``)."""
        future = self.dht.store(
            revocations_key(self.prefix), record, expires_at, subkey=coordinator.public_key.id, return_future=True
        )
        if wait:
            future.result(timeout=STORE_TIMEOUT_S)
