"""Size bounds on the run's DHT records, enforced by every DHT node of the run (issue #14).

The DHT stores what anyone sends. Readers verify every value of the run's keys (``protocol.
records``), but a node would still keep, and hand to every reader, whatever an attacker stored
under those keys. ``RunRecordBounds`` is a hivemind record validator: a node refuses to store
(or accept from another node) a value of one of the run's keys that is larger than the
largest value its writers ever produce, a subkey longer than an id, or a value stored without
a subkey. Other keys (hivemind's own matchmaking records) are left to hivemind.
"""

from __future__ import annotations

import logging

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from protocol.membership import members_key, revocations_key
from protocol.statesync import digest_key

logger = logging.getLogger(__name__)

MAX_DIGEST_RECORD_BYTES = 1024
"""A signed digest record is ~300 bytes (``statesync.make_digest_record``)."""
MAX_TOKEN_BYTES = 2048
"""An access token is ~360 bytes (``tokens.issue_token``)."""
MAX_REVOCATIONS_BYTES = 2 * 2**20
"""The coordinator's signed revocation list: ~55 bytes per revoked key, so ~38,000 keys."""
MAX_SUBKEY_BYTES = 128
"""Subkeys are public ids (``ed25519:...``) or libp2p peer ids, well under this."""


class RunRecordBounds(RecordValidatorBase):
    """Refuses oversized values (and malformed subkeys) under one run's keys."""

    def __init__(self, prefix: str) -> None:
        self._limits = {
            DHTID.generate(source=digest_key(prefix)).to_bytes(): MAX_DIGEST_RECORD_BYTES,
            DHTID.generate(source=members_key(prefix)).to_bytes(): MAX_TOKEN_BYTES,
            DHTID.generate(source=revocations_key(prefix)).to_bytes(): MAX_REVOCATIONS_BYTES,
        }

    def validate(self, record: DHTRecord) -> bool:
        limit = self._limits.get(record.key)
        if limit is None:
            return True
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, b"") or len(record.subkey) > MAX_SUBKEY_BYTES:
            logger.debug("refused a run record with a missing or oversized subkey (%d bytes)", len(record.subkey))
            return False
        if len(record.value) > limit:
            logger.debug("refused a run record of %d bytes (limit %d)", len(record.value), limit)
            return False
        return True
