"""The coordinator's identity, as the peer pins it.

The peer talks plain gRPC to its coordinator, so anyone on the path could answer a join: with
another spec, their own bootstrap peers, their own relays. The coordinator therefore signs
each join answer with its key, bound to the request it answers
(``protocol.kinds.JOIN_ANSWER``), and the peer reads the answer only from that signed body
(``verified_answer``). Which key is the coordinator's: the one the operator printed (``swarmtrain
peer --coordinator-key``), else the one this peer met first at that address, kept in its
checkpoint directory (``PinnedKeys``, like SSH's known_hosts); a later answer signed by another
key is refused with the fix. Heartbeats and reports stay unsigned: an on-path attacker can
still drop or delay them (as it can drop anything), not change what the peer trains.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from google.protobuf.message import DecodeError

from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import ConfigError, IdentityError, MalformedMessageError
from protocol.identity import PublicKey
from protocol.messages import SignedMessage

__all__ = ["PINS_FILE", "CoordinatorIdentityError", "PinnedKeys", "verified_answer"]

logger = logging.getLogger(__name__)

PINS_FILE = "coordinators.json"
MAX_PINS_BYTES = 1 << 20


class CoordinatorIdentityError(ConfigError):
    """A join answer that is not provably the pinned coordinator's."""


def verified_answer(
    response: pb.JoinResponse, *, request_nonce: bytes, address: str, expected: PublicKey | None
) -> tuple[pb.JoinResponse, PublicKey]:
    """The answer signed inside ``response`` and its signer, once the signature holds, the
    answer is to this request (``request_nonce``) and the signer is ``expected`` (when given).
    ``CoordinatorIdentityError`` saying what is wrong otherwise."""
    where = f"the coordinator at {address}"
    if not response.HasField("signed_answer"):
        raise CoordinatorIdentityError(
            f"{where} sent an unsigned join answer: it runs an older release, or something on the path "
            "rewrote it; ask the operator which"
        )
    try:
        message = SignedMessage.from_proto(response.signed_answer)
    except MalformedMessageError as exc:
        raise CoordinatorIdentityError(f"{where} sent a malformed signed answer ({exc})") from exc
    if message.kind != kinds.JOIN_ANSWER or not message.signer.verify(message.signature, message.signing_bytes()):
        raise CoordinatorIdentityError(f"{where} sent a join answer whose signature does not hold")
    if expected is not None and message.signer != expected:
        raise CoordinatorIdentityError(
            f"{where} answered with key {message.signer.id}, not the coordinator's {expected.id}: something on the "
            "path answers for it, or the operator changed its key (then pass the new one with --coordinator-key, "
            f"or delete that address from {PINS_FILE} in the peer's --checkpoint-dir)"
        )
    body = pb.JoinAnswerBody()
    try:
        body.ParseFromString(message.body)
    except DecodeError as exc:
        raise CoordinatorIdentityError(f"{where} signed an unreadable join answer ({exc})") from exc
    if body.request_nonce != request_nonce:
        raise CoordinatorIdentityError(f"{where} sent a signed answer to another request (a replay)")
    if bytes(body.answer.coordinator_public_key) != message.signer.raw:
        raise CoordinatorIdentityError(f"{where} signed an answer that names another coordinator key")
    return body.answer, message.signer


class PinnedKeys:
    """Coordinator keys this peer met, by the address it reached them at (``HOST:PORT`` →
    public id), in ``directory/coordinators.json``; nothing is kept without a directory."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / PINS_FILE if directory is not None else None

    def _read(self) -> dict[str, str]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            raw = self.path.read_bytes()
            pins = json.loads(raw) if len(raw) <= MAX_PINS_BYTES else None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path}: unreadable ({exc}); delete it to pin coordinators afresh") from exc
        if not isinstance(pins, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pins.items()):
            raise ConfigError(f"{self.path}: not a map of HOST:PORT to key ids; delete it to pin coordinators afresh")
        return pins

    def expected(self, address: str) -> PublicKey | None:
        """The key pinned for ``address``; None if none is."""
        pinned = self._read().get(address)
        if pinned is None:
            return None
        try:
            return PublicKey.from_id(pinned)
        except IdentityError as exc:
            raise ConfigError(f"{self.path}: the key pinned for {address} is not a public id ({exc})") from exc

    def remember(self, address: str, key: PublicKey) -> None:
        """Pin ``key`` for ``address`` (atomically; an address already pinned keeps its key)."""
        if self.path is None:
            return
        pins = self._read()
        if address in pins:
            return
        pins[address] = key.id
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, self.path)
        logger.info("pinned the coordinator key %s for %s in %s", key.id, address, self.path)
