"""Coordinator-signed access tokens.

A token says: "the coordinator with key C admits the peer with key P to the run whose spec
digest is D, from ``issued_at`` until ``expires_at``". It is a ``SignedMessage`` of kind
``TOKEN_KIND`` whose body is an ``AccessTokenBody`` protobuf. A token is a bearer
credential bound to a peer key: presenting it proves nothing unless the presenter also signs
with that key (the coordinator's RPCs); in averaging a token counts only for the libp2p peer
id it names (``protocol.membership``).

``verify_token`` rejects forged, tampered, expired, not-yet-valid, wrong-run and
wrong-peer tokens, each with its own ``TokenError`` subclass and a readable reason.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb
from protocol.errors import (
    BadSignatureError,
    IdentityError,
    MalformedMessageError,
    TokenError,
    TokenExpiredError,
    TokenWrongPeerError,
    TokenWrongRunError,
    WrongKindError,
    WrongSignerError,
)
from protocol.identity import Identity, PublicKey
from protocol.messages import SignedMessage, sign_message

TOKEN_KIND = "swarmtrain.access-token.v1"
TOKEN_ID_BYTES = 16
DEFAULT_SKEW_S = 30.0


@dataclass(frozen=True)
class AccessToken:
    """A decoded (not yet verified) access token."""

    run_digest: str
    peer_key: PublicKey
    issued_at: float
    expires_at: float
    token_id: bytes
    libp2p_peer_id: str
    message: SignedMessage

    def to_bytes(self) -> bytes:
        return self.message.to_bytes()


def issue_token(
    coordinator: Identity,
    *,
    run_digest: str,
    peer_key: PublicKey,
    now: float,
    ttl_s: float,
    libp2p_peer_id: str = "",
) -> AccessToken:
    """Issue a token valid for ``ttl_s`` seconds from ``now``."""
    if ttl_s <= 0:
        raise ValueError(f"token ttl must be positive, got {ttl_s}")
    body = pb.AccessTokenBody(
        run_digest=run_digest,
        peer_public_key=peer_key.raw,
        issued_at=now,
        expires_at=now + ttl_s,
        token_id=secrets.token_bytes(TOKEN_ID_BYTES),
        libp2p_peer_id=libp2p_peer_id,
    )
    message = sign_message(coordinator, TOKEN_KIND, body.SerializeToString(deterministic=True), now=now)
    return _from_message(message, body)


def decode_token(data: bytes) -> AccessToken:
    """Parse token bytes; raises ``MalformedMessageError`` for anything that is not a token."""
    message = SignedMessage.from_bytes(data)
    if message.kind != TOKEN_KIND:
        raise WrongKindError(f"expected an access token, got a {message.kind!r} message")
    body = pb.AccessTokenBody()
    try:
        body.ParseFromString(message.body)
    except (DecodeError, ValueError) as exc:
        raise MalformedMessageError(f"access token body does not decode ({exc})") from exc
    return _from_message(message, body)


def _from_message(message: SignedMessage, body: pb.AccessTokenBody) -> AccessToken:
    try:
        peer_key = PublicKey(bytes(body.peer_public_key))
    except IdentityError as exc:
        raise MalformedMessageError(f"access token peer key: {exc}") from exc
    if len(body.token_id) != TOKEN_ID_BYTES:
        raise MalformedMessageError("access token id has the wrong length")
    return AccessToken(
        run_digest=body.run_digest,
        peer_key=peer_key,
        issued_at=body.issued_at,
        expires_at=body.expires_at,
        token_id=bytes(body.token_id),
        libp2p_peer_id=body.libp2p_peer_id,
        message=message,
    )


def verify_token(
    token: AccessToken,
    *,
    coordinator_key: PublicKey,
    run_digest: str,
    now: float,
    peer_key: PublicKey | None = None,
    skew_s: float = DEFAULT_SKEW_S,
) -> None:
    """Raise a ``TokenError`` (or ``VerificationError``) unless the token admits its peer now.

    ``peer_key`` is the key the presenter proved it holds; ``None`` skips that check (for
    callers that bind the key in another way, such as a delegation signature).
    """
    message = token.message
    if not message.signer.verify(message.signature, message.signing_bytes()):
        raise BadSignatureError("access token signature does not match its content")
    if message.signer != coordinator_key:
        raise WrongSignerError(f"access token issued by {message.signer.id}, not by this run's coordinator")
    if token.run_digest != run_digest:
        raise TokenWrongRunError(f"access token is for run {token.run_digest!r}, not {run_digest!r}")
    if peer_key is not None and token.peer_key != peer_key:
        raise TokenWrongPeerError(f"access token belongs to {token.peer_key.id}, not {peer_key.id}")
    if not token.issued_at < token.expires_at:
        raise TokenError("access token validity window is empty")
    if now + skew_s < token.issued_at:
        raise TokenExpiredError("access token is not valid yet (issued in the future; check the clock)")
    if now >= token.expires_at:
        raise TokenExpiredError(f"access token expired {now - token.expires_at:.0f} s ago")
