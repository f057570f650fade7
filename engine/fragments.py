"""How the averaged vector is cut into fragments that are averaged at once (``averaging.
streams`` in the spec), each by its own all-reduce over its own libp2p streams.

The cut depends only on what every member of a run shares (the vector's length and the
spec), never on a peer's hardware: members with different GPU counts, or none, cut alike, so
fragment ``f`` of one member is averaged with fragment ``f`` of every other.
"""

from __future__ import annotations

__all__ = ["FRAGMENT_ALIGN", "MIN_FRAGMENT_VALUES", "fragment_bounds", "fragment_group_id"]

FRAGMENT_ALIGN = 4096
"""Fragments start at multiples of this many values (a multiple of every codec's block: the
``sparse`` codec's blocks are up to 4096 values, and its mask is relative to a block's start)."""
MIN_FRAGMENT_VALUES = 2**16
"""A vector is cut into no more fragments than it has runs of this many values: below it, a
fragment's all-reduce costs more in messages than its stream gains."""


def fragment_bounds(numel: int, streams: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each fragment of a vector of ``numel`` values cut for ``streams``
    streams: contiguous, in order, covering the vector, all but the last a multiple of
    ``FRAGMENT_ALIGN`` long and as equal as that allows. At least one fragment (an empty
    vector is one empty fragment)."""
    if numel < 0 or streams < 1:
        raise ValueError(f"need numel >= 0 and streams >= 1, got {numel} and {streams}")
    count = max(1, min(streams, numel // MIN_FRAGMENT_VALUES))
    blocks = -(-numel // FRAGMENT_ALIGN)
    bounds = []
    start = 0
    for index in range(count):
        # fragment ``index`` ends after its share of the vector's aligned blocks
        end = min(numel, (blocks * (index + 1) // count) * FRAGMENT_ALIGN)
        bounds.append((start, end))
        start = end
    return bounds


def fragment_group_id(group_id: bytes, index: int) -> bytes:
    """The all-reduce group id of fragment ``index`` of a group: the group's own id for
    fragment 0 (so one fragment is exactly the plain all-reduce), distinct ids for the others."""
    if index < 0:
        raise ValueError(f"fragment index must be >= 0, got {index}")
    return group_id if index == 0 else group_id + b"/fragment/" + str(index).encode()
