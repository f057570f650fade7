"""Authorized averaging: only peers the coordinator admitted take part in a run's averaging.

Each admitted peer publishes its access token in the DHT under ``members_key(prefix)``, with
its libp2p peer id as the subkey. The token is signed by the coordinator and binds the run,
the peer's key and that libp2p peer id; libp2p authenticates the remote peer id of every
connection (its secure channel), so presenting someone else's token gets an intruder
nothing. ``MemberGate`` turns those records into the set of libp2p peer ids that may join a
group, be a group's leader, send parts or download state. Records that do not verify are
ignored (logged at debug level): the DHT of a run is open to anyone.

Without a coordinator (a standalone swarm) there are no tokens and no gate: anyone who knows
the run may average, as in hivemind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from protocol.errors import SwarmtrainError
from protocol.identity import PublicKey
from protocol.tokens import AccessToken, decode_token, verify_token

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 2.0
"""A peer id not known yet triggers a DHT lookup at most this often."""


def members_key(prefix: str) -> str:
    """The DHT key under which a run's admitted peers publish their tokens."""
    return f"{prefix}.members"


class MemberGate:
    """Which libp2p peer ids the run's coordinator admitted, from the tokens in the DHT."""

    def __init__(
        self, *, coordinator_key: PublicKey, run_digest: str, key: str, refresh_interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        self.coordinator_key, self.run_digest, self.key = coordinator_key, run_digest, key
        self.refresh_interval_s = refresh_interval_s
        self._members: dict[str, float] = {}
        """libp2p peer id -> when its token expires."""
        self._last_refresh = float("-inf")

    def update(self, records: dict[Any, Any], *, now: float) -> None:
        """Add the peers whose records ({subkey: token bytes}) hold valid tokens; forget expired ones.

        Known members are kept until their tokens expire: a lookup that sees only part of
        the DHT must not turn away a peer admitted a moment ago."""
        members = {peer_id: expires for peer_id, expires in self._members.items() if expires > now}
        for subkey, value in records.items():
            token = self.verified(subkey, value, now=now)
            if token is not None:
                members[token.libp2p_peer_id] = max(members.get(token.libp2p_peer_id, 0.0), token.expires_at)
        self._members = members

    def verified(self, subkey: Any, value: Any, *, now: float) -> AccessToken | None:
        """The token in one DHT record if it admits the peer id it is stored under, else None."""
        value = getattr(value, "value", value)  # hivemind's ValueWithExpiration
        if not isinstance(subkey, str) or not isinstance(value, bytes):
            logger.debug("ignoring a members record of types %s/%s", type(subkey).__name__, type(value).__name__)
            return None
        try:
            token = decode_token(value)
            verify_token(token, coordinator_key=self.coordinator_key, run_digest=self.run_digest, now=now)
        except SwarmtrainError as exc:
            logger.debug("ignoring the members record of %s: %s", subkey, exc)
            return None
        if token.libp2p_peer_id != subkey:
            logger.debug("ignoring the members record of %s: its token is for %s", subkey, token.libp2p_peer_id)
            return None
        return token

    def is_member(self, peer_id: str, *, now: float) -> bool:
        """Whether ``peer_id`` holds a token valid ``now`` (no lookup)."""
        return self._members.get(peer_id, float("-inf")) > now

    async def admitted(self, peer_id: str, fetch: Callable[[], Awaitable[dict[Any, Any] | None]]) -> bool:
        """``is_member``, looking the members up again (``fetch``) when ``peer_id`` is unknown
        and the last lookup is older than ``refresh_interval_s``."""
        if self.is_member(peer_id, now=time.time()):
            return True
        if time.monotonic() - self._last_refresh < self.refresh_interval_s:
            return False
        self._last_refresh = time.monotonic()
        try:
            records = await fetch()
        except Exception as exc:  # noqa: BLE001 - a failed lookup admits nobody new, breaks nothing
            logger.warning("could not look up the run's members: %s", exc)
            records = None
        self.update(records if isinstance(records, dict) else {}, now=time.time())
        return self.is_member(peer_id, now=time.time())
