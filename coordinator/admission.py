"""Admission: who may join the run, decided from a signed join request.

A join request is a ``SignedMessage`` of kind ``kinds.JOIN`` whose body is a ``JoinBody``.
The signer is the peer. The account it earns for is the peer itself, or the signer of an
optional ``account_endorsement`` (kind ``kinds.ACCOUNT_ENDORSEMENT``, body = the peer's raw
public key), so one account can run several peers without sharing its key. In allowlist
mode the account must be listed; a banned peer or account is refused at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, BadSignatureError, MalformedMessageError, WrongRunError
from protocol.identity import PublicKey
from protocol.messages import MessageVerifier, SignedMessage

logger = logging.getLogger(__name__)

ENDORSEMENT_MAX_AGE_S = 365 * 86400.0


@dataclass(frozen=True)
class Admitted:
    peer: PublicKey
    account: PublicKey
    body: pb.JoinBody


def parse_body(message_type: type, data: bytes, what: str):  # type: ignore[no-untyped-def]
    """Decode a protobuf body; ``MalformedMessageError`` naming ``what`` if it does not."""
    body = message_type()
    try:
        body.ParseFromString(data)
    except (DecodeError, ValueError) as exc:
        raise MalformedMessageError(f"{what} body does not decode ({exc})") from exc
    return body


def admit(
    envelope: pb.SignedEnvelope,
    *,
    verifier: MessageVerifier,
    now: float,
    run_digest: str,
    mode: str,
    allowlist: set[str],
    banned: set[str],
    source: str = "",
) -> Admitted:
    """Verify a join request and apply the admission policy; raises with a readable reason.
    Its nonce is recorded (against ``source``'s share of the replay guard) only once it is
    admitted: a refused stranger's join takes no slot, so strangers cannot fill the guard and
    lock the allowlisted out."""
    message = SignedMessage.from_proto(envelope)
    verifier.verify(message, now=now, kind=kinds.JOIN, record=False)
    body = parse_body(pb.JoinBody, message.body, "join")
    if body.spec_digest and body.spec_digest != run_digest:
        raise WrongRunError(f"this peer runs spec {body.spec_digest}, the coordinator's run is {run_digest}")
    account = _account(body, message.signer, now)
    for key in {message.signer.id, account.id}:
        if key in banned:
            raise AdmissionError(f"{key} is banned from this run")
    if mode == "allowlist" and account.id not in allowlist:
        raise AdmissionError(f"account {account.id} is not on this run's allowlist")
    verifier.record(message, now=now, source=source)
    return Admitted(peer=message.signer, account=account, body=body)


def _account(body: pb.JoinBody, peer: PublicKey, now: float) -> PublicKey:
    if not body.HasField("account_endorsement"):
        return peer
    endorsement = SignedMessage.from_proto(body.account_endorsement)
    MessageVerifier(max_age_s=ENDORSEMENT_MAX_AGE_S).verify(
        endorsement, now=now, kind=kinds.ACCOUNT_ENDORSEMENT, check_replay=False
    )
    if endorsement.body != peer.raw:
        raise BadSignatureError("the account endorsement is for another peer key")
    return endorsement.signer
