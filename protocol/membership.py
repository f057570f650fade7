"""Authorized averaging: only peers the coordinator admitted take part in a run's averaging.

Each admitted peer publishes its access token in the DHT under ``members_key(prefix)``, with
its libp2p peer id as the subkey. The token is signed by the coordinator and binds the run,
the peer's key and that libp2p peer id; libp2p authenticates the remote peer id of every
connection (its secure channel), so presenting someone else's token gets an intruder
nothing. The coordinator also publishes a signed revocation list (``revocations_key``): the
keys of peers it banned; their tokens stop counting within ``RECHECK_S``. ``MemberGate``
turns those records into the set of libp2p peer ids that may join a
group, be a group's leader, send parts or download state. Records that do not verify are
ignored (logged at debug level): the DHT of a run is open to anyone.

Without a coordinator (a standalone swarm) there are no tokens and no gate: anyone who knows
the run may average, as in hivemind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from protocol import kinds
from protocol.errors import MalformedMessageError, SwarmtrainError, WrongSignerError
from protocol.identity import Identity, PublicKey
from protocol.messages import MessageVerifier, SignedMessage, sign_message
from protocol.tokens import AccessToken, decode_token, verify_token

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 2.0
"""A peer id not known yet triggers a DHT lookup at most this often."""
RECHECK_S = 30.0
MAX_SIGHTED = 10_000
"""Unknown peer ids a gate remembers having looked up for (then it forgets them all)."""
"""Known members are looked up again (for revocations) at least this often."""
REVOCATIONS_MAX_AGE_S = 30 * 86400.0 + 60.0
"""A revocation list stays in force at least as long as the longest token a spec allows."""


def members_key(prefix: str) -> str:
    """The DHT key under which a run's admitted peers publish their tokens."""
    return f"{prefix}.members"


def revocations_key(prefix: str) -> str:
    """The DHT key of the coordinator's signed list of peers whose tokens no longer count."""
    return f"{prefix}.revoked"


def make_revocations(coordinator: Identity, peer_keys: set[str], *, now: float) -> bytes:
    """The coordinator's signed revocation list: the keys of peers it banned (or whose account
    it banned or took off the allowlist); their tokens stop counting at once."""
    body = json.dumps({"peers": sorted(peer_keys)}, sort_keys=True).encode()
    return sign_message(coordinator, kinds.REVOCATIONS, body, now=now).to_bytes()


def parse_revocations(data: Any, *, coordinator_key: PublicKey, now: float) -> tuple[float, frozenset[str]]:
    """(when it was signed, the revoked peer keys); raises ``VerificationError``."""
    data = getattr(data, "value", data)
    if not isinstance(data, bytes):
        raise MalformedMessageError(f"revocation list is {type(data).__name__}, not bytes")
    message = SignedMessage.from_bytes(data)
    MessageVerifier(max_age_s=REVOCATIONS_MAX_AGE_S).verify(
        message, now=now, kind=kinds.REVOCATIONS, check_replay=False
    )
    if message.signer != coordinator_key:
        raise WrongSignerError(f"revocation list signed by {message.signer.id}, not by this run's coordinator")
    try:
        peers = json.loads(message.body)["peers"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MalformedMessageError("revocation list body is not {peers: [...]}") from exc
    if not isinstance(peers, list) or not all(isinstance(k, str) for k in peers):
        raise MalformedMessageError("revocation list peers are not a list of key ids")
    return message.timestamp, frozenset(peers)


@dataclass(frozen=True)
class Lookup:
    """What the DHT holds for a run: the members records and the revocation list(s)."""

    members: dict[Any, Any] | None
    revocations: dict[Any, Any] | None

    @classmethod
    def from_found(cls, members: Any, revocations: Any) -> Lookup:
        """From what ``DHT.get(key, latest=True)`` returned for the two keys (None, or a value
        with expiration whose value is a subkey dictionary; anything else counts as nothing)."""

        def dictionary(found: Any) -> dict[Any, Any] | None:
            value = getattr(found, "value", None)
            return value if isinstance(value, dict) else None

        return cls(dictionary(members), dictionary(revocations))


class MemberGate:
    """Which libp2p peer ids the run's coordinator admitted, from the tokens in the DHT."""

    def __init__(
        self,
        *,
        coordinator_key: PublicKey,
        run_digest: str,
        prefix: str,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.coordinator_key, self.run_digest = coordinator_key, run_digest
        self.key, self.revocations_key = members_key(prefix), revocations_key(prefix)
        self.refresh_interval_s, self.recheck_s = refresh_interval_s, recheck_s
        self._members: dict[str, tuple[float, str]] = {}
        """libp2p peer id -> (when its token expires, the peer key it was issued to)."""
        self._revoked: frozenset[str] = frozenset()
        self._revoked_at = float("-inf")
        self._last_refresh = float("-inf")
        self._sighted: set[str] = set()
        """Unknown peer ids looked up for at least once (``admitted``)."""
        self._renewing: asyncio.Future[None] | None = None
        """A lookup running behind a ``stale_ok`` admission."""

    def update(self, lookup: Lookup, *, now: float) -> None:
        """Add the peers whose records ({subkey: token bytes}) hold valid tokens; forget expired
        ones; take the newest valid revocation list.

        Known members are kept until their tokens expire: a lookup that sees only part of
        the DHT must not turn away a peer admitted a moment ago."""
        for subkey, value in (lookup.revocations or {}).items():
            try:
                signed_at, revoked = parse_revocations(value, coordinator_key=self.coordinator_key, now=now)
            except SwarmtrainError as exc:
                logger.debug("ignoring the revocation list under %s: %s", subkey, exc)
                continue
            if signed_at > self._revoked_at:
                self._revoked_at, self._revoked = signed_at, revoked
        members = {peer_id: entry for peer_id, entry in self._members.items() if entry[0] > now}
        for subkey, value in (lookup.members or {}).items():
            token = self.verified(subkey, value, now=now)
            if token is not None:
                expires = max(members.get(token.libp2p_peer_id, (0.0, ""))[0], token.expires_at)
                members[token.libp2p_peer_id] = (expires, token.peer_key.id)
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

    @property
    def revoked(self) -> frozenset[str]:
        """The peer keys (public ids) of the newest valid revocation list seen."""
        return self._revoked

    def is_member_key(self, peer_key: str, *, now: float) -> bool:
        """Whether some libp2p peer holds a token valid ``now`` for the peer key ``peer_key``
        (a public id) that was not revoked: whether that key's signed records count."""
        if peer_key in self._revoked:
            return False
        return any(key == peer_key and expires > now for expires, key in self._members.values())

    def refresh(self, dht: Any, *, max_age_s: float = 0.0) -> None:
        """Look the run's members up in ``dht`` (a hivemind DHT, from the host process) now,
        unless the last lookup is younger than ``max_age_s``."""
        finish = self.start_refresh(dht, max_age_s=max_age_s)
        if finish is not None:
            finish()

    def start_refresh(self, dht: Any, *, max_age_s: float = 0.0) -> Callable[[], None] | None:
        """``refresh`` begun: both keys are looked up at once, beside whatever else the caller
        starts (a lookup takes a second on a home link); the returned call waits for them and
        takes what they found. None when the last lookup is younger than ``max_age_s``."""
        if time.monotonic() - self._last_refresh < max_age_s:
            return None
        members = dht.get(self.key, latest=True, return_future=True)
        revocations = dht.get(self.revocations_key, latest=True, return_future=True)

        def finish() -> None:
            lookup = Lookup.from_found(members.result(), revocations.result())
            self._last_refresh = time.monotonic()
            self.update(lookup, now=time.time())

        return finish

    def is_member(self, peer_id: str, *, now: float) -> bool:
        """Whether ``peer_id`` holds a token valid ``now`` that was not revoked (no lookup)."""
        expires, peer_key = self._members.get(peer_id, (float("-inf"), ""))
        return expires > now and peer_key not in self._revoked

    async def admitted(self, peer_id: str, fetch: Callable[[], Awaitable[Lookup]], *, stale_ok: bool = False) -> bool:
        """``is_member``, looking the run up again (``fetch``) when ``peer_id`` is unknown and
        never looked up for, or the last lookup is older than ``refresh_interval_s``, or when it
        is older than ``recheck_s`` (so that a revocation takes effect within that time). The
        first sighting of an unknown peer always looks: a newcomer whose token was stored a
        moment after the last lookup is not turned away for the rest of a round's window.
        ``stale_ok``: a peer that was a member at the last lookup is admitted at once when the
        recheck is due, the lookup running in the background (for a download whose content is
        verified whoever serves it: a revocation then takes effect one lookup later)."""
        since = time.monotonic() - self._last_refresh
        known = self.is_member(peer_id, now=time.time())
        first = not known and peer_id not in self._sighted
        if first:
            if len(self._sighted) >= MAX_SIGHTED:  # peer ids are free to mint: bounded memory
                self._sighted.clear()
            self._sighted.add(peer_id)
        if (known and since < self.recheck_s) or (not known and not first and since < self.refresh_interval_s):
            return known
        if known and stale_ok:
            if self._renewing is None or self._renewing.done():
                self._renewing = asyncio.ensure_future(self._look_up(fetch))
            return True
        await self._look_up(fetch)
        return self.is_member(peer_id, now=time.time())

    async def _look_up(self, fetch: Callable[[], Awaitable[Lookup]]) -> None:
        self._last_refresh = time.monotonic()
        try:
            lookup = await fetch()
        except Exception as exc:  # noqa: BLE001 - a failed lookup admits nobody new, breaks nothing
            logger.warning("could not look up the run's members: %s", exc)
            lookup = Lookup(None, None)
        self.update(lookup, now=time.time())
