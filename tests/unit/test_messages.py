from __future__ import annotations

import dataclasses

import pytest

from protocol.errors import (
    BadSignatureError,
    MalformedMessageError,
    ReplayedMessageError,
    StaleMessageError,
    WrongKindError,
    WrongSignerError,
)
from protocol.identity import Identity
from protocol.messages import MessageVerifier, ReplayGuard, SignedMessage, sign_message

NOW = 1_800_000_000.0
KIND = "swarmtrain.heartbeat.v1"


@pytest.fixture
def alice() -> Identity:
    return Identity.generate()


def test_valid_message_passes_once_and_survives_the_wire(alice: Identity) -> None:
    msg = sign_message(alice, KIND, b"body", now=NOW)
    decoded = SignedMessage.from_bytes(msg.to_bytes())
    assert decoded == msg
    verifier = MessageVerifier()
    verifier.verify(decoded, now=NOW + 1, kind=KIND, signer=alice.public_key)
    with pytest.raises(ReplayedMessageError):
        verifier.verify(decoded, now=NOW + 2, kind=KIND)


@pytest.mark.parametrize(
    "change",
    [
        {"body": b"bodY"},
        {"kind": "swarmtrain.round-report.v1"},
        {"timestamp": NOW + 1},
        {"nonce": b"\x00" * 16},
    ],
)
def test_tampering_with_any_field_breaks_the_signature(alice: Identity, change: dict) -> None:
    msg = sign_message(alice, KIND, b"body", now=NOW)
    tampered = dataclasses.replace(msg, **change)
    with pytest.raises(BadSignatureError):
        MessageVerifier().verify(tampered, now=NOW, kind=tampered.kind)


def test_substituted_signer_is_rejected(alice: Identity) -> None:
    msg = sign_message(alice, KIND, b"body", now=NOW)
    mallory = Identity.generate()
    claimed = dataclasses.replace(msg, signer=mallory.public_key)
    with pytest.raises(BadSignatureError):
        MessageVerifier().verify(claimed, now=NOW, kind=KIND)


def test_wrong_signer_is_rejected(alice: Identity) -> None:
    msg = sign_message(alice, KIND, b"body", now=NOW)
    with pytest.raises(WrongSignerError):
        MessageVerifier().verify(msg, now=NOW, kind=KIND, signer=Identity.generate().public_key)


def test_wrong_kind_is_rejected(alice: Identity) -> None:
    msg = sign_message(alice, KIND, b"body", now=NOW)
    with pytest.raises(WrongKindError):
        MessageVerifier().verify(msg, now=NOW, kind="swarmtrain.round-report.v1")


def test_stale_and_future_messages_are_rejected(alice: Identity) -> None:
    verifier = MessageVerifier(max_age_s=300, max_future_s=30)
    with pytest.raises(StaleMessageError, match="old"):
        verifier.verify(sign_message(alice, KIND, b"", now=NOW - 301), now=NOW, kind=KIND)
    with pytest.raises(StaleMessageError, match="future"):
        verifier.verify(sign_message(alice, KIND, b"", now=NOW + 31), now=NOW, kind=KIND)
    verifier.verify(sign_message(alice, KIND, b"", now=NOW + 29), now=NOW, kind=KIND)


def test_rejected_messages_are_not_remembered(alice: Identity) -> None:
    verifier = MessageVerifier()
    msg = sign_message(alice, KIND, b"body", now=NOW)
    with pytest.raises(WrongKindError):
        verifier.verify(msg, now=NOW, kind="other")
    verifier.verify(msg, now=NOW, kind=KIND)


def test_replay_guard_forgets_only_after_the_age_window(alice: Identity) -> None:
    verifier = MessageVerifier(max_age_s=60)
    msg = sign_message(alice, KIND, b"", now=NOW)
    verifier.verify(msg, now=NOW, kind=KIND)
    with pytest.raises(ReplayedMessageError):
        verifier.verify(msg, now=NOW + 59, kind=KIND)
    # once stale, the age check refuses it, and the nonce can be forgotten
    with pytest.raises(StaleMessageError):
        verifier.verify(msg, now=NOW + 61, kind=KIND)
    verifier.verify(sign_message(alice, KIND, b"", now=NOW + 61), now=NOW + 61, kind=KIND)
    assert len(verifier.replay_guard) == 1


def test_replay_guard_cap_refuses_instead_of_forgetting(alice: Identity) -> None:
    verifier = MessageVerifier(replay_guard=ReplayGuard(max_entries=2))
    for _ in range(2):
        verifier.verify(sign_message(alice, KIND, b"", now=NOW), now=NOW, kind=KIND)
    with pytest.raises(ReplayedMessageError, match="too many"):
        verifier.verify(sign_message(alice, KIND, b"", now=NOW), now=NOW, kind=KIND)


@pytest.mark.parametrize("data", [b"", b"\xff\xff\xff", b"garbage" * 10])
def test_malformed_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(MalformedMessageError):
        SignedMessage.from_bytes(data)


def test_structurally_invalid_envelopes_are_rejected(alice: Identity) -> None:
    good = sign_message(alice, KIND, b"", now=NOW).to_proto()
    for field, value in [("nonce", b"short"), ("signer", b"x" * 31), ("kind", ""), ("timestamp", float("nan"))]:
        env = type(good)()
        env.CopyFrom(good)
        setattr(env, field, value)
        with pytest.raises(MalformedMessageError):
            SignedMessage.from_proto(env)
