"""Receipts: a reducer's signed word that it averaged a sender's contribution.

In a round's all-reduce every member reduces one range of the vector and every other member
sends it its parts of that range. With the averaged parts it returns to a sender (the first,
and the last), a member's reducer signs a receipt (``sign_receipt``): "in round ``round`` of run ``run`` my reducer took
``sender``'s parts with weight ``weight``" (and why it bounded them, if it did). The sender
keeps its group-mates' receipts and puts them in its round report (``GroupMember.receipt``).

What it is for: the coordinator credits a claim only on the word of another account in its
group (``coordinator.credits``). A member that dies during the all-reduce, after its reducer
served the reporter, never reports; in a pair that left the survivor with no witness, although
its work is in the state the swarm goes on from. The dead member's receipt is its word, given
before it died. It attests the weight, never the state after the round (which a reducer does
not know when it signs): a receipt is worth what that member's report would be, less the
digest, and binds no one but its signer.

A receipt has no time window (a report may reach the coordinator long after its round, from
the peer's outbox); it is bound to its run, its round and its sender instead, and a claim is
decided once per key and round, so a receipt replayed gains nothing. ``read_receipt`` checks
everything and raises ``ReceiptError`` naming the first fault: another member's bytes are
untrusted input, and a bad receipt costs only itself, never the report that carries it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import IdentityError, MalformedMessageError
from protocol.identity import Identity, PublicKey
from protocol.messages import MAX_OFFENCE_CHARS, MAX_REPORTED_SAMPLES, SignedMessage, sign_message

__all__ = [
    "MAX_RECEIPT_BYTES",
    "REPORTED_RECEIPTS",
    "Receipt",
    "ReceiptError",
    "read_receipt",
    "reported",
    "sign_receipt",
]

MAX_RECEIPT_BYTES = 1024
"""The largest receipt a member keeps or a report may carry (one is ~230 bytes, ~530 with the
longest offence); a larger one is dropped unread."""
REPORTED_RECEIPTS = 4
"""Receipts a round report carries at most (``reported``). A voucher counts only where no
member of another account reported, which in a group of five or more would take four deaths
in one all-reduce; the bound keeps a report of the largest group under the coordinator's
request limit and its checks at a few signatures per report, at any group size."""


class ReceiptError(ValueError):
    """A receipt that does not say what it must, or is not its reducer's."""


@dataclass(frozen=True)
class Receipt:
    """A verified receipt."""

    reducer: str
    """The public id of the member whose reducer signed it."""
    run: str
    round: int
    sender: str
    """The public id of the member whose parts it took."""
    weight: float
    offence: str = ""


def sign_receipt(
    identity: Identity, *, run: str, round_: int, sender: PublicKey, weight: float, offence: str, now: float
) -> bytes:
    """The serialized signed receipt of this peer's reducer for ``sender``'s parts."""
    body = pb.ReceiptBody(
        run=run, round=round_, sender=sender.raw, weight=float(weight), offence=offence[:MAX_OFFENCE_CHARS]
    )
    return sign_message(identity, kinds.RECEIPT, body.SerializeToString(), now=now).to_bytes()


def read_receipt(data: bytes, *, reducer: str, run: str, round_: int, sender: str) -> Receipt:
    """The receipt in ``data`` if it is ``reducer``'s, signed, for ``sender``'s parts in round
    ``round_`` of ``run``, with a weight and offence a report may carry; ``ReceiptError`` naming
    the first thing that is not so."""
    if not isinstance(data, bytes) or not data:
        raise ReceiptError("no receipt")
    if len(data) > MAX_RECEIPT_BYTES:
        raise ReceiptError(f"a receipt is at most {MAX_RECEIPT_BYTES} bytes, got {len(data)}")
    try:
        message = SignedMessage.from_bytes(data)
        signer = PublicKey.from_id(reducer)
    except (MalformedMessageError, IdentityError) as exc:
        raise ReceiptError(f"unreadable receipt: {exc}") from exc
    if message.kind != kinds.RECEIPT:
        raise ReceiptError(f"a receipt is of kind {kinds.RECEIPT!r}, got {message.kind!r}")
    if message.signer != signer:
        raise ReceiptError(f"receipt signed by {message.signer.id}, not by the member {reducer}")
    if not signer.verify(message.signature, message.signing_bytes()):
        raise ReceiptError(f"receipt's signature does not match its content and signer {reducer}")
    body = pb.ReceiptBody()
    try:
        body.ParseFromString(message.body)
    except (DecodeError, TypeError, ValueError) as exc:
        raise ReceiptError(f"receipt body is no ReceiptBody ({exc})") from exc
    if body.run != run:
        raise ReceiptError(f"receipt is for another run ({body.run[:80]!r})")
    if body.round != round_:
        raise ReceiptError(f"receipt is for round {body.round}, not {round_}")
    try:
        named = PublicKey(bytes(body.sender)).id
    except IdentityError as exc:
        raise ReceiptError(f"receipt names no sender key ({exc})") from exc
    if named != sender:
        raise ReceiptError(f"receipt is for {named}'s parts, not {sender}'s")
    if not (math.isfinite(body.weight) and 0 <= body.weight <= MAX_REPORTED_SAMPLES):
        raise ReceiptError(f"receipt weight must be in [0, {MAX_REPORTED_SAMPLES}], got {body.weight!r}")
    if len(body.offence) > MAX_OFFENCE_CHARS or "\x00" in body.offence:
        raise ReceiptError(f"receipt offence must be at most {MAX_OFFENCE_CHARS} characters without NUL")
    return Receipt(reducer, run, body.round, sender, body.weight, body.offence)


def reported(receipts: dict[str, bytes]) -> dict[str, bytes]:
    """The receipts (member's public id → receipt; a peer holds none of its own) a report
    carries: those of the ``REPORTED_RECEIPTS`` members with the smallest ids (any choice
    serves; this one is the same whenever the report is made again)."""
    chosen = sorted(key for key, receipt in receipts.items() if receipt)
    return {key: receipts[key] for key in chosen[:REPORTED_RECEIPTS]}
