"""What a state download asks for, said in its request: the digests the downloader would take, or
any state of a round after one it names. A server whose state is not one of them answers with
its state's metadata alone and opens no file, so that a refusal costs the downloader's link no
tensor bytes. (Before, the server streamed the state right behind its metadata; on a home link a
refused state's bytes already on their way, up to a whole state per server asked, held up the
next server's answer for tens of seconds and timed out downloads one after another.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.wire_fields import read_fields

MAX_WANTED_DIGESTS = 16
"""Digests one request may name (a downloader names one, or a few fallbacks)."""
MAX_DIGEST_CHARS = 96
"""A digest's longest spelling (``blake3:`` and 64 hex digits: 71)."""
MAX_WANTED_BYTES = 2048
"""A request's largest serialized size; more is refused before it is parsed."""


@dataclass(frozen=True)
class Wanted:
    """The states a downloader takes: one whose digest is in ``digests``, or one of a round after
    ``newer_than``; ``digests`` None: any state (the caller verifies it)."""

    digests: frozenset[str] | None
    newer_than: int | None = None

    def takes(self, round_: Any, digest: Any) -> bool:
        """Whether a state claimed as (``round_``, ``digest``) is one asked for."""
        if not isinstance(digest, str):
            return False
        if self.digests is None or digest in self.digests:
            return True
        return self.newer_than is not None and type(round_) is int and round_ > self.newer_than

    def dumps(self, serializer: Any) -> bytes:
        digests = None if self.digests is None else sorted(self.digests)
        return bytes(serializer.dumps([digests, self.newer_than]))

    @classmethod
    def parse(cls, serializer: Any, raw: bytes) -> Wanted | None:
        """The request in ``raw``, or None if it is not one (too large, unreadable, too many or
        malformed digests, a round that is not a non-negative integer)."""
        values = read_fields(serializer, raw, 2, MAX_WANTED_BYTES)
        if values is None:
            return None
        digests, newer_than = values
        if newer_than is not None and (type(newer_than) is not int or newer_than < 0):
            return None
        if digests is None:
            return cls(None, newer_than)
        if not isinstance(digests, list | tuple) or len(digests) > MAX_WANTED_DIGESTS:
            return None
        if not all(isinstance(d, str) and 0 < len(d) <= MAX_DIGEST_CHARS for d in digests):
            return None
        return cls(frozenset(digests), newer_than)
