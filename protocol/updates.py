"""A round's averaged update as a newcomer downloads it from a member that kept it
(``engine.update_transfer``), before the host applies it (``peer.roll_forward``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import MalformedTensorError

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FetchedUpdate:
    """The update that took the state of ``round`` (digest ``pre``) to that of ``round + 1``
    (digest ``post``, as its server claims), checked for shape, not yet for its values or the
    digest it makes."""

    round: int
    pre: str
    post: str
    left_out: Ranges
    """Ranges the round did not average (an audit left a reducer's out): the state keeps its
    values there, as every member's landing did."""
    parts: Sequence[tuple[int, int, bytes]]
    """``(start, values, codec bytes)``, in order, covering the vector but for ranges left out
    (the reducers that failed there sent none)."""
    seconds: float
    server: str

    @property
    def size(self) -> int:
        return sum(len(buffer) for _, _, buffer in self.parts)


def parse_ranges(raw: Any, numel: int) -> Ranges:
    """Sorted, disjoint ``[start, end)`` ranges inside a vector of ``numel`` values, as received;
    ``MalformedTensorError`` for anything else."""
    if not isinstance(raw, list | tuple):
        raise MalformedTensorError("left-out ranges malformed")
    ranges: list[tuple[int, int]] = []
    end = 0
    for pair in raw:
        if not isinstance(pair, list | tuple) or len(pair) != 2 or any(type(v) is not int for v in pair):
            raise MalformedTensorError("left-out ranges malformed")
        lo, hi = pair
        if not end <= lo < hi <= numel:
            raise MalformedTensorError("left-out ranges overlap or run past the vector")
        ranges.append((lo, hi))
        end = hi
    return tuple(ranges)


def left_out_between(left_out: Ranges, start: int, stop: int) -> bool:
    """Whether ``[start, stop)`` (``start < stop``) lies wholly inside the union of ``left_out``
    (sorted, disjoint ranges, ``parse_ranges``): the gap a round's failed reducers left between
    two parts that arrived."""
    if start >= stop:
        return False
    cursor = start
    for lo, hi in left_out:
        if hi <= cursor:
            continue
        if lo > cursor:
            return False
        cursor = hi
        if cursor >= stop:
            return True
    return False
