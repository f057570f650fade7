"""Adapter: swarmtrain access tokens as hivemind's DHT/averaging authorizer.

hivemind signs every DHT request and response with an RSA key of its own and attaches a
``hivemind.proto.auth_pb2.AccessToken`` that must vouch for that RSA key. We fill that
protobuf as follows:

- ``username``: our coordinator-signed token (``protocol.tokens``), base64;
- ``public_key``: this process's hivemind RSA public key;
- ``signature``: the *peer's* Ed25519 signature over (token id, RSA public key), a
  delegation that binds the RSA key to the peer the token was issued to, so a token copied
  off the wire is useless without the peer's private key;
- ``expiration_time``: the token's expiry (ISO 8601, informational).

``is_token_valid`` checks the coordinator's signature, the run digest, the validity window,
the delegation, and an optional revocation hook (bans take effect at once). Kept apart
from ``protocol.tokens`` because importing hivemind imports torch.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from hivemind.proto.auth_pb2 import AccessToken as HivemindAccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from protocol.errors import BadSignatureError, MalformedMessageError, TokenError, VerificationError
from protocol.identity import Identity, PublicKey
from protocol.messages import pae
from protocol.tokens import AccessToken, decode_token, verify_token

logger = logging.getLogger(__name__)

DELEGATION_TAG = b"swarmtrain/hivemind-rsa-delegation/v1"
TokenSource = Callable[[], Awaitable[bytes]]


def delegation_bytes(token_id: bytes, rsa_public_key: bytes) -> bytes:
    """What a peer signs to vouch for its hivemind RSA key under a given token."""
    return pae(DELEGATION_TAG, token_id, rsa_public_key)


class SwarmTokenAuthorizer(TokenAuthorizerBase):
    """hivemind ``TokenAuthorizerBase`` backed by coordinator-issued swarmtrain tokens."""

    def __init__(
        self,
        *,
        identity: Identity,
        coordinator_key: PublicKey,
        run_digest: str,
        token_source: TokenSource,
        refresh_margin_s: float = 60.0,
        is_revoked: Callable[[PublicKey], bool] | None = None,
        clock: Callable[[], float] = get_dht_time,
        local_private_key: RSAPrivateKey | None = None,
    ) -> None:
        super().__init__(local_private_key)
        self._identity = identity
        self._coordinator_key = coordinator_key
        self._run_digest = run_digest
        self._token_source = token_source
        self._refresh_margin_s = refresh_margin_s
        self._is_revoked = is_revoked
        self._clock = clock

    async def get_token(self) -> HivemindAccessToken:
        token_bytes = await self._token_source()
        token = decode_token(token_bytes)
        verify_token(
            token,
            coordinator_key=self._coordinator_key,
            run_digest=self._run_digest,
            peer_key=self._identity.public_key,
            now=self._clock(),
        )
        rsa_public = self.local_public_key.to_bytes()
        return HivemindAccessToken(
            username=base64.b64encode(token_bytes).decode("ascii"),
            public_key=rsa_public,
            expiration_time=datetime.fromtimestamp(token.expires_at, timezone.utc).isoformat(),
            signature=self._identity.sign(delegation_bytes(token.token_id, rsa_public)),
        )

    def is_token_valid(self, access_token: HivemindAccessToken) -> bool:
        try:
            self.check(access_token)
        except VerificationError as exc:
            logger.info("refused a hivemind request or response: %s", exc)
            return False
        return True

    def check(self, access_token: HivemindAccessToken) -> AccessToken:
        """Like ``is_token_valid`` but raises the reason; returns the decoded token."""
        token = _decode_username(access_token.username)
        verify_token(token, coordinator_key=self._coordinator_key, run_digest=self._run_digest, now=self._clock())
        delegation = delegation_bytes(token.token_id, bytes(access_token.public_key))
        if not token.peer_key.verify(bytes(access_token.signature), delegation):
            raise BadSignatureError(f"hivemind key of {token.peer_key.id} is not vouched for by that peer")
        if self._is_revoked is not None and self._is_revoked(token.peer_key):
            raise TokenError(f"peer {token.peer_key.id} has been banned from this run")
        return token

    def does_token_need_refreshing(self, access_token: HivemindAccessToken) -> bool:
        try:
            token = _decode_username(access_token.username)
        except VerificationError:
            return True
        return token.expires_at - self._clock() < self._refresh_margin_s


def _decode_username(username: str) -> AccessToken:
    try:
        raw = base64.b64decode(username.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise MalformedMessageError("hivemind access token does not carry a swarmtrain token") from exc
    return decode_token(raw)


def static_token_source(token: bytes) -> TokenSource:
    """A token source that always returns the same token (until a refresh hook replaces it)."""

    async def source() -> bytes:
        return token

    return source
