"""Signed messages: who said what, when, once.

A ``SignedMessage`` is (kind, body, signer, nonce, timestamp, signature). The signature
covers a pre-authentication encoding of all five other fields (a domain tag, then each
field length-prefixed, in the spirit of DSSE's PAE), so no field can be moved, swapped or
re-interpreted as another kind. On the wire it is the ``SignedEnvelope`` protobuf.

``MessageVerifier.verify`` checks, in order: the kind, the signature, the expected signer,
the timestamp window and the nonce (replays). It raises a ``VerificationError`` subclass
that says which; only a message that passes every check is recorded as seen.

Time is passed in (``now``) so that every rule is unit-tested without sleeping.
"""

from __future__ import annotations

import heapq
import math
import secrets
import struct
import threading
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb
from protocol.errors import (
    BadSignatureError,
    IdentityError,
    MalformedMessageError,
    ReplayedMessageError,
    StaleMessageError,
    WrongKindError,
    WrongSignerError,
)
from protocol.identity import Identity, PublicKey

DOMAIN_TAG = b"swarmtrain/signed-message/v1"
NONCE_BYTES = 16
MAX_KIND_CHARS = 128
MAX_REPORTED_SAMPLES = 2**40
"""Most samples a round report may give for its reporter or any group member (~1e12: a
million times a large GPU node's round); past it the coordinator refuses the report."""
MAX_OFFENCE_CHARS = 300
"""Longest reason a round report may give for a member's offence (``GroupMember.offence``)."""


def pae(*parts: bytes) -> bytes:
    """Domain tag, part count, then each part prefixed with its 8-byte big-endian length."""
    out = [DOMAIN_TAG, struct.pack(">Q", len(parts))]
    for part in parts:
        out.append(struct.pack(">Q", len(part)))
        out.append(part)
    return b"".join(out)


@dataclass(frozen=True)
class SignedMessage:
    """A statement ``body`` of type ``kind`` made by ``signer`` at ``timestamp``."""

    kind: str
    body: bytes
    signer: PublicKey
    nonce: bytes
    timestamp: float
    signature: bytes

    def signing_bytes(self) -> bytes:
        """The exact bytes the signature covers."""
        return signing_bytes(self.kind, self.body, self.signer, self.nonce, self.timestamp)

    def to_proto(self) -> pb.SignedEnvelope:
        return pb.SignedEnvelope(
            kind=self.kind,
            body=self.body,
            signer=self.signer.raw,
            nonce=self.nonce,
            timestamp=self.timestamp,
            signature=self.signature,
        )

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString()

    @classmethod
    def from_proto(cls, envelope: pb.SignedEnvelope) -> SignedMessage:
        """Structural checks only; ``MessageVerifier.verify`` does the rest."""
        if not envelope.kind or len(envelope.kind) > MAX_KIND_CHARS:
            raise MalformedMessageError(f"message kind must be 1..{MAX_KIND_CHARS} characters")
        if len(envelope.nonce) != NONCE_BYTES:
            raise MalformedMessageError(f"message nonce must be {NONCE_BYTES} bytes, got {len(envelope.nonce)}")
        if not math.isfinite(envelope.timestamp):
            raise MalformedMessageError("message timestamp is not a finite number")
        try:
            signer = PublicKey(bytes(envelope.signer))
        except IdentityError as exc:
            raise MalformedMessageError(f"message signer: {exc}") from exc
        return cls(
            kind=envelope.kind,
            body=bytes(envelope.body),
            signer=signer,
            nonce=bytes(envelope.nonce),
            timestamp=envelope.timestamp,
            signature=bytes(envelope.signature),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedMessage:
        """Decode a serialized ``SignedEnvelope``; ``MalformedMessageError`` if it is not one."""
        envelope = pb.SignedEnvelope()
        try:
            envelope.ParseFromString(data)
        except (DecodeError, TypeError, ValueError) as exc:
            raise MalformedMessageError(f"not a signed envelope ({exc})") from exc
        return cls.from_proto(envelope)


def signing_bytes(kind: str, body: bytes, signer: PublicKey, nonce: bytes, timestamp: float) -> bytes:
    """Pre-authentication encoding of a message's fields."""
    return pae(kind.encode("utf-8"), signer.raw, nonce, struct.pack(">d", timestamp), body)


def sign_message(
    identity: Identity, kind: str, body: bytes, *, now: float, nonce: bytes | None = None
) -> SignedMessage:
    """Sign ``body`` as a message of ``kind`` at time ``now``."""
    if nonce is None:
        nonce = secrets.token_bytes(NONCE_BYTES)
    assert len(nonce) == NONCE_BYTES, "nonce length"
    raw = signing_bytes(kind, body, identity.public_key, nonce, now)
    return SignedMessage(kind, body, identity.public_key, nonce, now, identity.sign(raw))


@dataclass
class ReplayGuard:
    """Remembers (signer, nonce) pairs until the message could no longer pass the age check.

    Memory is bounded by the message rate times the age window; ``max_entries`` is a hard cap
    past which new messages are refused rather than old nonces forgotten (forgetting would
    re-open replays). A message recorded with its ``source`` (the host it came from) counts
    against that source's share, ``max_per_source``: one host cannot fill the guard and lock
    everyone else out (its own messages are refused first). Only messages the coordinator
    acted on are recorded (``MessageVerifier.record``): a stranger's refused join takes no slot.
    """

    max_entries: int = 1_000_000
    max_per_source: int = 20_000
    """A host's live entries: ~66 messages a second sustained over the 300 s age window, above
    what a few hundred honest peers behind one NAT send (a heartbeat every 5 s and a report a
    round each)."""
    _expiry: dict[tuple[bytes, bytes], tuple[float, str]] = field(default_factory=dict)
    _heap: list[tuple[float, bytes, bytes]] = field(default_factory=list)
    _per_source: dict[str, int] = field(default_factory=dict)

    def seen(self, signer: bytes, nonce: bytes, *, now: float) -> bool:
        """Whether (``signer``'s raw public key, ``nonce``) is remembered."""
        self._evict(now)
        return (signer, nonce) in self._expiry

    def remember(self, signer: bytes, nonce: bytes, *, until: float, now: float, source: str = "") -> None:
        self._evict(now)
        if source and self._per_source.get(source, 0) >= self.max_per_source:
            raise ReplayedMessageError(f"too many recent messages from {source}; try again later")
        if len(self._expiry) >= self.max_entries:
            raise ReplayedMessageError("too many recent messages to check for replays; try again later")
        self._expiry[(signer, nonce)] = (until, source)
        if source:
            self._per_source[source] = self._per_source.get(source, 0) + 1
        heapq.heappush(self._heap, (until, signer, nonce))

    def __len__(self) -> int:
        return len(self._expiry)

    def _evict(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            until, signer, nonce = heapq.heappop(self._heap)
            entry = self._expiry.get((signer, nonce))
            if entry is not None and entry[0] == until:
                del self._expiry[(signer, nonce)]
                source = entry[1]
                if source:
                    left = self._per_source[source] - 1
                    if left:
                        self._per_source[source] = left
                    else:
                        del self._per_source[source]


@dataclass
class MessageVerifier:
    """Verifies signed messages against a time window and a replay guard."""

    max_age_s: float = 300.0
    """A message older than this (by its own timestamp) is stale."""
    max_future_s: float = 30.0
    """Clock skew tolerated for timestamps ahead of ours."""
    replay_guard: ReplayGuard = field(default_factory=ReplayGuard)
    _replay_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """The replay check and record are one step (several threads verify at once)."""

    def verify(
        self,
        message: SignedMessage,
        *,
        now: float,
        kind: str,
        signer: PublicKey | None = None,
        check_replay: bool = True,
        record: bool = True,
        source: str = "",
    ) -> None:
        """Raise a ``VerificationError`` unless ``message`` passes every check; then record it
        (unless ``record`` is False: the caller records it with ``record`` once it decided to
        act on it, so that a message it refuses takes no slot of the replay guard)."""
        if message.kind != kind:
            raise WrongKindError(f"expected a {kind!r} message, got {message.kind!r}")
        if not message.signer.verify(message.signature, message.signing_bytes()):
            raise BadSignatureError(f"{kind}: signature does not match the content and signer {message.signer.id}")
        if signer is not None and message.signer != signer:
            raise WrongSignerError(f"{kind}: signed by {message.signer.id}, expected {signer.id}")
        age = now - message.timestamp
        if age > self.max_age_s:
            raise StaleMessageError(f"{kind}: message is {age:.0f} s old (limit {self.max_age_s:.0f} s)")
        if -age > self.max_future_s:
            raise StaleMessageError(
                f"{kind}: message is {-age:.0f} s in the future (clock skew limit {self.max_future_s:.0f} s)"
            )
        if check_replay:
            if record:
                self.record(message, now=now, source=source)
            else:
                with self._replay_lock:  # ``seen`` evicts: one thread at a time
                    seen = self.replay_guard.seen(message.signer.raw, message.nonce, now=now)
                if seen:
                    raise ReplayedMessageError(f"{kind}: message from {message.signer.id} was already received")

    def screen(self, message: SignedMessage, *, now: float, kind: str) -> None:
        """Raise the ``VerificationError`` ``verify`` would for what needs no signature check
        (kind, age, a replay already seen), for a caller that must not spend one on a message
        that would fail anyway (a datagram whose source can be forged)."""
        if message.kind != kind:
            raise WrongKindError(f"expected a {kind!r} message, got {message.kind!r}")
        age = now - message.timestamp
        if age > self.max_age_s or -age > self.max_future_s:
            raise StaleMessageError(
                f"{kind}: message is {age:.0f} s old (limits {self.max_age_s:.0f} s, {self.max_future_s:.0f} s ahead)"
            )
        with self._replay_lock:
            seen = self.replay_guard.seen(message.signer.raw, message.nonce, now=now)
        if seen:
            raise ReplayedMessageError(f"{kind}: message from {message.signer.id} was already received")

    def record(self, message: SignedMessage, *, now: float, source: str = "") -> None:
        """Record a verified ``message`` as received (from host ``source``, counted against its
        share; "" counts against none); ``ReplayedMessageError`` if it already was, even by
        another thread since its ``verify``."""
        self.record_nonce(
            message.signer.raw, message.nonce, message.timestamp, now=now, source=source, what=message.kind
        )

    def record_nonce(
        self, signer: bytes, nonce: bytes, timestamp: float, *, now: float, source: str = "", what: str = "message"
    ) -> None:
        """``record`` for a message another process verified (``coordinator.front``): its
        signer's raw public key, nonce and timestamp; ``ReplayedMessageError`` if already
        recorded here (a heartbeat replayed to a second heartbeat process counts once)."""
        with self._replay_lock:
            if self.replay_guard.seen(signer, nonce, now=now):
                raise ReplayedMessageError(f"{what}: message from {PublicKey(signer).id} was already received")
            until = max(timestamp + self.max_age_s, now + 1.0)  # kept past this batch, however old
            self.replay_guard.remember(signer, nonce, until=until, now=now, source=source)
