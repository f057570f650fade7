from __future__ import annotations

import dataclasses

import pytest

from protocol import coordinator_pb2 as pb
from protocol.errors import (
    BadSignatureError,
    MalformedMessageError,
    TokenExpiredError,
    TokenWrongPeerError,
    TokenWrongRunError,
    WrongKindError,
    WrongSignerError,
)
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.tokens import TOKEN_KIND, AccessToken, decode_token, issue_token, verify_token

NOW = 1_800_000_000.0
RUN = "sha256:" + "ab" * 32
OTHER_RUN = "sha256:" + "cd" * 32


@pytest.fixture
def coordinator() -> Identity:
    return Identity.generate()


@pytest.fixture
def peer() -> Identity:
    return Identity.generate()


def issue(coordinator: Identity, peer: Identity, **kw: object) -> AccessToken:
    args: dict = {"run_digest": RUN, "peer_key": peer.public_key, "now": NOW, "ttl_s": 3600.0}
    args.update(kw)
    return issue_token(coordinator, **args)


def check(token: AccessToken, coordinator: Identity, peer: Identity, *, now: float = NOW + 10, run: str = RUN) -> None:
    verify_token(token, coordinator_key=coordinator.public_key, run_digest=run, peer_key=peer.public_key, now=now)


def test_valid_token_survives_the_wire(coordinator: Identity, peer: Identity) -> None:
    token = decode_token(issue(coordinator, peer, libp2p_peer_id="12D3Koo").to_bytes())
    check(token, coordinator, peer)
    assert token.libp2p_peer_id == "12D3Koo" and token.message.signer == coordinator.public_key


def test_forged_token_signed_by_another_key(coordinator: Identity, peer: Identity) -> None:
    forged = issue(Identity.generate(), peer)
    with pytest.raises(WrongSignerError):
        check(forged, coordinator, peer)


def test_tampered_token_body(coordinator: Identity, peer: Identity) -> None:
    token = issue(coordinator, peer)
    body = pb.AccessTokenBody()
    body.ParseFromString(token.message.body)
    body.expires_at += 10 * 86400
    tampered = decode_token(dataclasses.replace(token.message, body=body.SerializeToString()).to_bytes())
    with pytest.raises(BadSignatureError):
        check(tampered, coordinator, peer)


def test_expired_token(coordinator: Identity, peer: Identity) -> None:
    token = issue(coordinator, peer, ttl_s=60.0)
    check(token, coordinator, peer, now=NOW + 59)
    with pytest.raises(TokenExpiredError, match="expired"):
        check(token, coordinator, peer, now=NOW + 60)


def test_token_from_the_future(coordinator: Identity, peer: Identity) -> None:
    token = issue(coordinator, peer)
    with pytest.raises(TokenExpiredError, match="not valid yet"):
        check(token, coordinator, peer, now=NOW - 3600)


def test_wrong_run_token(coordinator: Identity, peer: Identity) -> None:
    with pytest.raises(TokenWrongRunError):
        check(issue(coordinator, peer), coordinator, peer, run=OTHER_RUN)


def test_token_presented_by_another_peer(coordinator: Identity, peer: Identity) -> None:
    with pytest.raises(TokenWrongPeerError):
        check(issue(coordinator, peer), coordinator, Identity.generate())


def test_replayed_token_of_other_kind(coordinator: Identity, peer: Identity) -> None:
    """A coordinator-signed message of another kind is not a token."""
    other = sign_message(coordinator, "swarmtrain.heartbeat.v1", b"", now=NOW)
    with pytest.raises(WrongKindError):
        decode_token(other.to_bytes())


@pytest.mark.parametrize("data", [b"", b"junk", b"\x0a\x02"])
def test_malformed_token_bytes(data: bytes) -> None:
    with pytest.raises((MalformedMessageError, WrongKindError)):
        decode_token(data)


def test_token_with_garbage_body(coordinator: Identity) -> None:
    msg = sign_message(coordinator, TOKEN_KIND, b"\xff\xff\xff\xff", now=NOW)
    with pytest.raises(MalformedMessageError):
        decode_token(msg.to_bytes())


def test_nonpositive_ttl_is_a_programming_error(coordinator: Identity, peer: Identity) -> None:
    with pytest.raises(ValueError):
        issue(coordinator, peer, ttl_s=0.0)
