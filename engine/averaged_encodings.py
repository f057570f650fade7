"""A reducer's one encoding of each averaged part, held only while a sender still needs it.

Every sender of a part gets the same bytes (``engine.allreduce``: one encoding per averaged
part, so that replicas stay bit-identical), so the reducer encodes each part once and hands the
same message to each sender. Kept until the round's serving ended, those encodings are the
reducer's whole share of the vector at the codec's width (a quarter of a model's fp32 bytes per
member of a group of two with fp16), held at the peak of the round beside the landing. A part's
encoding is let go as soon as every sender still in the round for it has taken it (its reply,
which holds the bytes until they are sent, is on its way); one a sender then asks for after all
is encoded again, and the encoding is a pure function of the part and the round's dither, so it
is the same bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from hivemind.proto import runtime_pb2

__all__ = ["AveragedEncodings"]


class AveragedEncodings:
    """Part index → the future of its one encoding, with how many senders took it."""

    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[runtime_pb2.Tensor]] = {}
        self._takers: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def future(
        self, part_index: int, encode: Callable[[], asyncio.Future[runtime_pb2.Tensor]]
    ) -> asyncio.Future[runtime_pb2.Tensor]:
        """Part ``part_index``'s encoding: the one begun already, else ``encode()`` begun now."""
        future = self._futures.get(part_index)
        if future is None:
            future = self._futures[part_index] = encode()
        return future

    def taken(self, part_index: int, failed_after: Sequence[float]) -> None:
        """One more sender took part ``part_index``'s encoding. ``failed_after`` is the reducer's
        ``sender_failed_after`` (per sender: the parts it got in before it failed, ``inf`` while it
        is in): once every sender in the round for this part took it, it goes."""
        count = self._takers.get(part_index, 0) + 1
        if count >= sum(part_index < failed for failed in failed_after):
            self._futures.pop(part_index, None)
            self._takers.pop(part_index, None)
        else:
            self._takers[part_index] = count

    def clear(self) -> None:
        """Every sender took its parts, or never will."""
        self._futures.clear()
        self._takers.clear()
