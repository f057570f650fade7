"""This peer's reducer's receipts for one round (``protocol.receipts``): who signs them, and how
they travel.

A reducer signs, per sender, the weight it averaged that sender's parts with, and sends the
receipt with the first averaged part it returns to it and again with the last (then naming
anything it bounded), in the reply's ``peer_id`` bytes (hivemind reads that field only in
requests; a reply names no peer); the sender keeps the latest. A member without an identity to sign
with (a bare averager, a test) sends none; a sender keeps a receipt only from a reply that
carries one no larger than ``MAX_RECEIPT_BYTES``, and checks nothing else: the coordinator
reads and judges it (``coordinator.rounds``), so a bad one costs only itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hivemind.proto import averaging_pb2

from protocol.errors import IdentityError
from protocol.identity import Identity, PublicKey
from protocol.receipts import MAX_RECEIPT_BYTES, sign_receipt

logger = logging.getLogger(__name__)

__all__ = ["ReceiptSigner", "attach", "taken"]


class ReceiptSigner:
    """Signs this peer's reducer's receipts for the senders of one group (libp2p id → the public
    id each gathered), for the round the group lands."""

    def __init__(self, identity: Identity, *, run: str, round_: int, ids: dict[str, str]) -> None:
        self.identity = identity
        self.run = run
        self.round = round_
        self.ids = ids

    def __call__(self, sender: Any, weight: float, offence: str) -> bytes:
        """The receipt for ``sender``'s (a libp2p peer id) parts; empty when it gathered no id
        that is a key (it earns nothing anyway)."""
        try:
            key = PublicKey.from_id(self.ids.get(str(sender), ""))
        except IdentityError:
            return b""
        return sign_receipt(
            self.identity, run=self.run, round_=self.round, sender=key, weight=weight, offence=offence, now=time.time()
        )


def attach(message: averaging_pb2.AveragingData, receipt: bytes) -> averaging_pb2.AveragingData:
    """``message`` (an averaged part for a sender) carrying ``receipt``."""
    if receipt:
        message.peer_id = receipt
    return message


def taken(message: averaging_pb2.AveragingData) -> bytes:
    """The receipt an averaged part carries, if any and not oversized (else empty)."""
    receipt = bytes(message.peer_id)
    if len(receipt) > MAX_RECEIPT_BYTES:
        logger.debug("dropping an oversized receipt (%d bytes)", len(receipt))
        return b""
    return receipt
