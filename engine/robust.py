"""The reducer's robust mean: how one part of the vector is averaged from every member's copy.

A member of a public run may send anything that decodes: a pseudo-gradient scaled by 100, or a
self-reported weight of 1e15. A plain weighted mean lets one such member move the whole swarm
(issue #14 measured a 4-peer run going from loss 2.67 to 248). The reducer holds every
member's copy of its part (``engine.allreduce.RobustPartReducer``), so it bounds each one
against the others before averaging:

1. **Weights** are capped at ``weight_cap`` (2) times the lower median of the contributing
   members' weights: a member's self-reported samples never count for more than that many
   typical members. A weight far above the others' is no evidence of a lie: time-bound inner
   phases give a datacenter GPU hundreds of times a laptop's samples, a member whose last
   rounds failed brings their work along, and a newcomer's first round counts a few samples
   (a soak with churn named an honest member whose 3,352 samples met a newcomer's 144). So a
   weight is only capped, never named, unless it exceeds ``max_weight``: more samples than any
   member can have processed (the run's credited maximum rate for a day, ``for_spec``).
2. **Norms**: each member's part is scaled down to at most ``clip`` (1) times the lower
   median of the contributing members' part norms (no clipping when that median is 0), so
   no member moves the mean further than a typical member does. Honest members' norms are
   close: measured on 4-peer runs here (16 rounds, 9 parts per member), the largest part
   norm was 1.44x the median, so clipping at the median shrinks an honest mean by a few
   percent; with a bound of 3x the median, one member sending 100x its pseudo-gradient still
   raised the honest peers' held-out loss by 14% (``tests/integration/test_hostile_peers.py``).
3. **Direction**: with 3 or more contributing members, a member whose part points against
   the others' (cosine with the weighted sum of the others' bounded parts below
   ``leave_out_cosine``, default -0.5) is left out of this part's mean. Members of a DiLoCo
   round start from the same state and descend the same loss, so their pseudo-gradients
   agree, part by part mostly: measured on a 4-peer run here (20 rounds, 1,280 member-parts
   of 32K values, ``tests/integration/test_hostile_peers.py``'s model), honest members'
   cosine with the others' sum had median 0.76, 1% below 0.085 and a minimum of -0.26; a
   sign-flipped member's is the negative of its honest one (median -0.76). Norms cannot see
   a sign flip.

A member is **named** (an offence, returned with the reason, to be reported and denied credit
for the round) when its weight exceeds ``max_weight``, or its norm exceeds ``flag`` (10) times
its bound (a part so far out carries nothing to trust and is left out, not clipped: clipped, a
random vector at the median norm still added noise worth +1.8% of held-out loss; one merely
clipped is not named).
Honest members mostly stay within 1.5x of the median, but not always: with a flag of 3 a
clean 4-peer run on a loaded CI machine named an honest member whose part was 3.7x the
median, and a named member loses its credit for the round; the attacks the tests try are
100x and 1000x. Or
when its parts, pooled over every part this reducer took from it in the round, point against
the others' (``Alignment``, cosine below ``min_cosine``, default 0): pooled over 16 parts an
honest member's cosine is far from 0, while a single part's can dip below it.

"Contributing" is a weight above ``MIN_CONTRIBUTING_WEIGHT``: members that count 0 (stale) or
take part only to receive the average (no samples) never set the medians. The lower median
is the ``(n-1)//2``-th smallest value, so with fewer than half of the contributing members
hostile it lies between two honest members' values: an attacker moves the mean by at most
``weight_cap`` times a typical member's share, each of its parts no longer than a typical
member's; a group of two (where nobody can tell who is right) bounds both by the smaller.

The result depends only on the parts and weights received, in sender order (summed in that
order), never on arrival order; every member still decodes the reducer's one encoding of it,
so replicas stay bit-identical whatever the rule does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from protocol.spec import AveragingSection, CreditsSection

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_FLAG",
    "DEFAULT_LEAVE_OUT_COSINE",
    "DEFAULT_MAX_WEIGHT",
    "DEFAULT_MIN_COSINE",
    "DEFAULT_WEIGHT_CAP",
    "HONEST_SPAN_S",
    "MIN_CONTRIBUTING_WEIGHT",
    "Alignment",
    "Reduced",
    "RobustRule",
    "robust_mean",
]

DEFAULT_CLIP = 2.0
DEFAULT_WEIGHT_CAP = 2.0
DEFAULT_FLAG = 10.0
DEFAULT_MIN_COSINE = 0.0
DEFAULT_LEAVE_OUT_COSINE = 0.0
MIN_MEMBERS_FOR_DIRECTION = 3
"""With two members, neither can be told from the other by direction."""
HONEST_SPAN_S = 86_400.0
"""``for_spec``'s ``max_weight`` is the samples of this long at the run's credited maximum rate
(``credits.max_samples_per_second``): a member whose rounds failed for a day re-syncs long
before (``peer.round.watchdog``), and a self-reported 1e15 is far above it."""
DEFAULT_MAX_WEIGHT = 10_000.0 * HONEST_SPAN_S
"""``max_weight`` at the spec's default ``max_samples_per_second`` (10,000)."""
MIN_CONTRIBUTING_WEIGHT = 1e-6
"""Weights at or below this (0 for a stale member, ~1e-12 for one with no samples) count
nothing and set no median."""


@dataclass(frozen=True)
class RobustRule:
    """The spec's ``averaging.robust`` settings, as the reducer applies them."""

    clip: float = DEFAULT_CLIP
    """Parts are scaled to at most this many times the median part norm (0: no clipping)."""
    weight_cap: float = DEFAULT_WEIGHT_CAP
    """Weights are capped at this many times the median weight (0: no cap)."""
    leave_out_cosine: float = DEFAULT_LEAVE_OUT_COSINE
    """A part whose cosine with the others' sum is below this is left out (-1: never)."""
    min_cosine: float = DEFAULT_MIN_COSINE
    """A member whose parts' pooled cosine with the others' is below this is named (-1: never)."""
    flag: float = DEFAULT_FLAG
    """A norm over this many times its bound names the member as an offender."""
    max_weight: float = DEFAULT_MAX_WEIGHT
    """A weight above this (samples no member can have processed) names the member; below it a
    weight is only capped."""

    @classmethod
    def off(cls) -> RobustRule:
        """The plain weighted mean: no cap, no clipping, no direction check."""
        return cls(clip=0, weight_cap=0, leave_out_cosine=-1, min_cosine=-1, max_weight=math.inf)

    @classmethod
    def for_spec(cls, averaging: AveragingSection, credits: CreditsSection | None = None) -> RobustRule:
        """The rule a run's reducers apply: the spec's keys, or ``off`` where ``robust`` is false;
        ``max_weight`` from ``credits.max_samples_per_second`` (``HONEST_SPAN_S``)."""
        if not averaging.robust:
            return cls.off()
        return cls(
            clip=averaging.clip,
            weight_cap=averaging.weight_cap,
            leave_out_cosine=averaging.leave_out_cosine,
            min_cosine=averaging.min_cosine,
            flag=averaging.flag,
            max_weight=(credits.max_samples_per_second * HONEST_SPAN_S) if credits is not None else DEFAULT_MAX_WEIGHT,
        )

    def __post_init__(self) -> None:
        if not (self.clip == 0 or self.clip >= 1) or not (self.weight_cap == 0 or self.weight_cap >= 1):
            raise ValueError(f"clip and weight_cap must be 0 (off) or >= 1, got {self.clip} and {self.weight_cap}")
        for name in ("leave_out_cosine", "min_cosine"):
            if not -1 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [-1, 1], got {getattr(self, name)}")
        if not self.flag >= 1:
            raise ValueError(f"flag must be >= 1, got {self.flag}")
        if not self.max_weight > 0:
            raise ValueError(f"max_weight must be > 0, got {self.max_weight}")


@dataclass
class Alignment:
    """One member's parts against the others', summed over parts: the pooled cosine is
    ``dot / sqrt(mine_sq * others_sq)``."""

    dot: float = 0.0
    mine_sq: float = 0.0
    others_sq: float = 0.0
    parts: int = 0
    left_out: int = 0

    def add(self, other: Alignment) -> None:
        self.dot += other.dot
        self.mine_sq += other.mine_sq
        self.others_sq += other.others_sq
        self.parts += other.parts
        self.left_out += other.left_out

    def cosine(self) -> float | None:
        """Pooled cosine; None if either side is all zeros."""
        norms = math.sqrt(self.mine_sq * self.others_sq)
        return self.dot / norms if norms > 0 else None


@dataclass
class Reduced:
    """One part's robust mean and what the reducer saw of each member in it."""

    mean: torch.Tensor
    offences: dict[int, str] = field(default_factory=dict)
    """Senders (by index) whose weight or norm exceeded ``flag`` times its bound, with why."""
    alignment: dict[int, Alignment] = field(default_factory=dict)
    """Senders (by index) whose direction was judged (3 or more contributing members)."""
    clipped: int = 0
    """Contributing senders whose part was scaled down to the norm bound."""
    capped: int = 0
    """Contributing senders whose weight was lowered to the weight cap."""


def direction_offence(alignment: Alignment, rule: RobustRule) -> str:
    """Why a member whose pooled ``alignment`` points against the others' is named ("" if not)."""
    cosine = alignment.cosine()
    if rule.min_cosine <= -1 or cosine is None or cosine >= rule.min_cosine:
        return ""
    return (
        f"its parts point against the others' (cosine {cosine:.3f} < {rule.min_cosine:g} over "
        f"{alignment.parts} parts; {alignment.left_out} left out)"
    )


def lower_median(values: Sequence[float]) -> float:
    """The ``(n-1)//2``-th smallest of ``values`` (the smaller middle one for even ``n``)."""
    if not values:
        raise ValueError("median of nothing")
    return sorted(values)[(len(values) - 1) // 2]


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], rule: RobustRule) -> Reduced:
    """The weighted mean of ``parts`` (one per sender, in sender order) under ``rule``, the
    senders (by index) named for their weight or norm, and each member's alignment with the
    others. Zeros if nobody contributes."""
    if len(parts) != len(weights) or not parts:
        raise ValueError(f"need one weight per part, got {len(parts)} parts and {len(weights)} weights")
    contributing = [i for i, weight in enumerate(weights) if weight > MIN_CONTRIBUTING_WEIGHT]
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    if not contributing:
        return Reduced(total)
    offences: dict[int, str] = {}
    used = [float(weight) if weight > MIN_CONTRIBUTING_WEIGHT else 0.0 for weight in weights]
    capped = 0
    if rule.weight_cap:
        typical = lower_median([used[i] for i in contributing])
        cap = rule.weight_cap * typical
        for i in contributing:
            if used[i] > cap:
                used[i] = cap
                capped += 1
    for i in contributing:
        if weights[i] > rule.max_weight:
            offences[i] = (
                f"weight {weights[i]:.4g} is over {rule.max_weight:.4g}, more than a member can have (left out)"
            )
    scale = [1.0] * len(parts)
    if rule.clip:
        norms = {i: float(torch.linalg.vector_norm(parts[i].float())) for i in contributing}
        typical_norm = lower_median(list(norms.values()))
        bound = rule.clip * typical_norm
        for i in contributing:
            if bound > 0 and norms[i] > bound:  # a median of 0 bounds nothing: no clipping
                scale[i] = bound / norms[i]
                if norms[i] > rule.flag * bound:
                    reason = (
                        f"part norm {norms[i]:.4g} is over {rule.flag * rule.clip:g}x the group's median "
                        f"{typical_norm:.4g} (left out)"
                    )
                    offences[i] = f"{offences[i]}; {reason}" if i in offences else reason
    # a member named for its weight or norm carries nothing to trust in this part: left out
    contributing = [i for i in contributing if i not in offences]
    if not contributing:
        return Reduced(total, offences)
    bounded = {"clipped": sum(1 for i in contributing if scale[i] < 1.0), "capped": capped}
    for i in contributing:
        total.add_(parts[i].float(), alpha=used[i] * scale[i])
    kept = contributing
    alignment: dict[int, Alignment] = {}
    directions = rule.leave_out_cosine > -1 or rule.min_cosine > -1
    if directions and len(contributing) >= MIN_MEMBERS_FOR_DIRECTION:
        kept = []
        # each member's part ``w·x`` against the others' sum ``total − w·x``, from two dot
        # products of ``x`` (no copy of the part per member: this runs for every part reduced)
        total_sq = float(torch.dot(total, total))
        for i in contributing:
            weight = used[i] * scale[i]
            part = parts[i].float()
            with_total, own_sq = float(torch.dot(part, total)), float(torch.dot(part, part))
            mine_sq = weight * weight * own_sq
            seen = Alignment(
                dot=weight * with_total - mine_sq,
                mine_sq=mine_sq,
                others_sq=max(total_sq - 2 * weight * with_total + mine_sq, 0.0),
                parts=1,
            )
            cosine = seen.cosine()
            if rule.leave_out_cosine > -1 and cosine is not None and cosine < rule.leave_out_cosine:
                seen.left_out = 1
            else:
                kept.append(i)
            alignment[i] = seen
        if len(kept) < len(contributing):
            if not kept:
                return Reduced(torch.zeros_like(total), offences, alignment, **bounded)
            total.zero_()
            for i in kept:
                total.add_(parts[i].float(), alpha=used[i] * scale[i])
    return Reduced(total.div_(sum(used[i] for i in kept)), offences, alignment, **bounded)
