"""Auditing reducers: a member re-computes one part of another member's reduction from the
senders' own copies and compares it with the bytes that reducer returned to everyone.

Robust averaging (``engine.robust``) bounds what a *sender* can do, but a *reducer* is trusted
with its range: one that returns a well-formed but wrong average (the same bytes to every
member, so their digests agree) moves the whole swarm, and nobody would notice. Every
reduction here is a pure function of what the reducer received (the senders' encoded parts
and weights, in sender order), the run's robust rule and the round's dither, so anyone holding
those inputs can redo it (BTARD, arXiv 2106.11257, checks its aggregators this way):

- **Who audits whom** (``auditee``): every member audits one reducer per round, a rotation of
  the reducers by the group id, so that each reducer is audited by one member when every member
  reduces (nobody audits itself).
- **What**: one part of that reducer's range, in one fragment, chosen by the auditor alone
  (``secrets``) before the round: a reducer cannot tell which of its parts will be checked, so
  one that falsifies a share ``f`` of its parts is caught with probability ``f`` per round, and
  one that shifts its whole average at once.
- **With what**: every sender keeps the encoded parts it sent until its next round begins
  (``SentParts``) and serves them to the group's members (``engine.auditing``); the auditor
  decodes them, takes the robust mean as the reducer must have, encodes it with the round's
  dither and compares the decoded results (``judge``). An honest reducer's result is the same
  bit for bit on the same build; across CPUs a summation order can flip the rounding of a few
  values, never many (``MAX_FLIPPED_SHARE``), and never move the part far
  (``MAX_DISTANCE``). A reducer may legitimately have dropped one sender (a broken stream, a
  part it refused): a result that matches the inputs less one sender is honest too. It may also
  have dropped every sender whose parts came too late (a reducer on a slow home link gives up on
  them at its sender timeout and serves them no average): each sender says, with the part it
  serves the auditor, whether the reducer served it its average (whether it holds all of it yet:
  one still on its way is not served), and a result that matches the
  inputs less the senders it did not serve is honest as well. A sender that says so falsely only
  adds one more honest candidate: the reducer that averaged its part still matches all inputs.
  "Not served" covers more than "dropped": a busy reducer whose average reached a sender after
  that sender's timeout used the sender's part all the same, so the reducer's inputs are all
  senders less *some* of those it did not serve (``leave_out_candidates``: every such subset
  while there are at most 6 unserved senders, else the likeliest ``MAX_LEFT_OUT_SETS``). The churn
  lab, with 12 peers on 2 cores, had three honest reducers convicted in one run for want of
  this (about a quarter of a part's values differing: the included late senders' share).

What it costs per member and round: the auditor fetches one part from each other sender (at
most ``PART_SIZE_BYTES`` each, ``(n - 1)`` parts), and re-computes one part; a sender keeps
what it sent (the encoded vector) until its next round, in a file beside its kept updates.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import secrets
import tempfile
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.robust import RobustRule, robust_mean

__all__ = [
    "MAX_DISTANCE",
    "MAX_FLIPPED_SHARE",
    "AuditTarget",
    "SentParts",
    "auditee",
    "choose_target",
    "judge",
    "leave_out_candidates",
    "reduce_like_a_reducer",
]

MAX_FLIPPED_SHARE = 1e-3
"""An honest reducer's encoded result may differ from a re-computation on another CPU in at most
this share of its values (a rounding flipped by a summation order; at least ``MIN_FLIPS``)."""
MIN_FLIPS = 16
MAX_DISTANCE = 0.05
"""...and by at most this much in L2 distance, relative to the re-computed part's norm."""


MAX_LEFT_OUT_SETS = 64
"""How many sets of senders that were served no average the re-computation tries left out, at
most (besides each single sender): every subset while there are up to 6 of them, else the
likeliest (``leave_out_candidates``); each try re-computes one part."""


def leave_out_candidates(senders: int, unserved: Collection[int]) -> list[int | frozenset[int] | None]:
    """The sets of senders an honest reducer may have left out of a part, likeliest first: none;
    all of ``unserved`` (the senders that do not hold its average: it gave up on their late
    parts); all of them but one (one whose average is late, not its part); each sender alone (a
    broken stream, a refused part); then subsets of ``unserved`` from both ends (two of them and
    all but those two, then three, ...), up to ``MAX_LEFT_OUT_SETS`` sets of them in all. A sender
    still waiting for the average it will get also says it holds none, so the set the reducer
    really dropped can be any subset. Each set appears once."""
    late = sorted(set(unserved))
    found: list[int | frozenset[int] | None] = [None]
    seen: set[frozenset[int]] = {frozenset()}
    budget = [MAX_LEFT_OUT_SETS]

    def add(candidate: int | frozenset[int]) -> None:
        key = frozenset({candidate}) if isinstance(candidate, int) else candidate
        if key in seen or (not isinstance(candidate, int) and budget[0] <= 0):
            return
        seen.add(key)
        found.append(candidate)
        if not isinstance(candidate, int):
            budget[0] -= 1

    if len(late) > 1:
        add(frozenset(late))
    for kept in late if len(late) > 2 else ():
        add(frozenset(late) - {kept})
    for sender in range(senders):
        add(sender)
    for small in range(2, len(late) // 2 + 1):  # each subset, then all of them but it
        for subset in itertools.combinations(late, small):
            if budget[0] <= 0:  # C(n, n/2) subsets: never walked past the budget
                return found
            add(frozenset(subset))
            add(frozenset(late) - frozenset(subset))
    return found


def _seed(group_id: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(bytes(group_id), digest_size=8, person=b"audit").digest(), "big")


def auditee(group_id: bytes, member: int, reducers: Sequence[int]) -> int | None:
    """The reducer (member index) that ``member`` audits in the group ``group_id``: reducers
    rotated by a non-zero shift the group id picks, so that with every member a reducer each
    reducer has exactly one auditor and nobody audits itself. A member that reduces nothing (a
    client) audits a reducer picked by its index. None if there is no other reducer."""
    order = sorted(set(reducers))
    others = [index for index in order if index != member]
    if not others:
        return None
    shift = _seed(group_id)
    if member not in order:
        return order[(shift + member) % len(order)]
    position = order.index(member)
    return order[(position + 1 + shift % (len(order) - 1)) % len(order)]


@dataclass(frozen=True)
class AuditTarget:
    """One part of one reducer's range in one fragment."""

    fragment: int
    reducer: int
    part: int


def choose_target(reducer: int, parts_by_fragment: Sequence[int]) -> AuditTarget | None:
    """A part of ``reducer``'s range, in a fragment where it has any, chosen with this process's
    own randomness (nobody else can predict it). ``parts_by_fragment[k]``: how many parts the
    reducer reduces in fragment ``k``. None if it reduces nothing."""
    candidates = [(fragment, part) for fragment, count in enumerate(parts_by_fragment) for part in range(count)]
    if not candidates:
        return None
    fragment, part = candidates[secrets.randbelow(len(candidates))]
    return AuditTarget(fragment, reducer, part)


class SentParts:
    """What this member sent each reducer in one fragment's all-reduce: encoded parts (the
    message's bytes as sent) and the weight that went with them, by (reducer, part).

    With ``spill`` (a directory) the parts go to a file there as they are kept (unnamed: the
    kernel frees it with the last reference) and are read back when an auditor asks, one part a
    round: the averager holds none of them, where it held the encoded vector (half a model's
    size with fp16) from its parts' sending until its next group."""

    def __init__(self, spill: Path | None = None) -> None:
        self._parts: dict[tuple[int, int], tuple[object, float]] = {}
        self._spilled: dict[tuple[int, int], tuple[int, int, float]] = {}  # offset, length, weight
        self._file = tempfile.TemporaryFile(dir=spill) if spill is not None else None
        self._lock = threading.Lock()

    def keep(self, reducer: int, part: int, encoded: object, weight: float) -> None:
        """(Writes to disk with ``spill``: call it off the event loop.)"""
        if self._file is None:
            self._parts[(reducer, part)] = (encoded, weight)
            return
        raw = encoded.SerializeToString()  # type: ignore[attr-defined]
        with self._lock:
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(raw)
            self._spilled[(reducer, part)] = (offset, len(raw), weight)

    def get(self, reducer: int, part: int) -> tuple[object, float] | None:
        if self._file is None:
            return self._parts.get((reducer, part))
        spilled = self._spilled.get((reducer, part))
        if spilled is None:
            return None
        offset, length, weight = spilled
        from hivemind.proto import runtime_pb2  # (only with spill: this module stays hivemind-free)

        with self._lock:
            self._file.seek(offset)
            raw = self._file.read(length)
        tensor = runtime_pb2.Tensor()
        tensor.ParseFromString(raw)
        return tensor, weight


def reduce_like_a_reducer(
    parts: Sequence[torch.Tensor | None],
    weights: Sequence[float],
    rule: RobustRule,
    leave_out: int | Collection[int] | None = None,
) -> torch.Tensor | None:
    """The mean a reducer following ``rule`` takes of ``parts`` (decoded, in sender order; None:
    a part it could not have used), less sender(s) ``leave_out``. None if no part is left."""
    left_out = {leave_out} if isinstance(leave_out, int) else set(leave_out or ())
    kept = [
        (part, weight) for i, (part, weight) in enumerate(zip(parts, weights)) if part is not None and i not in left_out
    ]
    if not kept:
        return None
    return robust_mean([part for part, _ in kept], [weight for _, weight in kept], rule).mean


def judge(returned: torch.Tensor, expected: torch.Tensor) -> str:
    """Why the reducer's ``returned`` part (decoded) is not the re-computed ``expected`` one
    (decoded from the same codec with the same dither); "" if it is, within a few flipped
    roundings."""
    if returned.shape != expected.shape:
        return f"its part has {returned.numel()} values, the re-computation {expected.numel()}"
    difference = returned.float() - expected.float()
    if not bool(torch.isfinite(difference).all()):
        return "its part holds values the re-computation does not (non-finite)"
    flipped = int(torch.count_nonzero(difference))
    scale = float(torch.linalg.vector_norm(expected.float()))
    distance = float(torch.linalg.vector_norm(difference))
    allowed = max(MIN_FLIPS, math.floor(MAX_FLIPPED_SHARE * expected.numel()))
    if flipped <= allowed and distance <= MAX_DISTANCE * scale:
        return ""
    relative = distance / scale if scale > 0 else math.inf
    return (
        f"{flipped} of {expected.numel()} values differ from the re-computation (relative L2 distance {relative:.3g})"
    )
