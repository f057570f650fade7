"""The run's learning-rate schedule, by the swarm's position (``[schedule]`` of the spec).

A peer's position is where the *swarm* is, not how many steps this peer took: inner step
``step`` of round ``round_`` is swarm step ``round_ x H + step``, and the swarm's tokens at
that point are ``swarm step x data.slots x inner.batch_size x sequence length`` (as if every
data stream trained). Every peer computes the same factor at the same point, whenever it
joined, so a late joiner does not restart warm-up, and decay follows the run's planned
total. Pure arithmetic: the coordinator may show it too.
"""

from __future__ import annotations

import math

from protocol.spec import RunSpec


def tokens_per_swarm_step(spec: RunSpec) -> int:
    """Tokens the swarm trains per inner step if every data stream trains."""
    seq_len = spec.sequence_length() or 1
    return spec.data.slots * spec.inner.batch_size * seq_len


def swarm_step(spec: RunSpec, round_: int, step: int) -> int:
    """The swarm's inner-step position at step ``step`` of round ``round_`` (rounds of H steps;
    a run bounded by time only counts rounds as one step each)."""
    h = spec.rounds.inner_steps
    return round_ * h + min(step, h - 1) if h is not None else round_


def swarm_tokens(spec: RunSpec, round_: int, step: int = 0) -> int:
    """The swarm's position in tokens at step ``step`` of round ``round_``."""
    return swarm_step(spec, round_, step) * tokens_per_swarm_step(spec)


def decay_factor(spec: RunSpec, tokens: int) -> float:
    """The schedule's decay at ``tokens`` (1 before any decay; warm-up not included)."""
    schedule = spec.schedule
    if schedule.kind == "constant" or schedule.total_tokens is None:
        return 1.0
    span = max(1, schedule.total_tokens - schedule.warmup_tokens)
    progress = min(1.0, max(0.0, (tokens - schedule.warmup_tokens) / span))
    floor = schedule.min_lr_ratio
    if schedule.kind == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_factor(spec: RunSpec, round_: int, step: int) -> float:
    """Linear warm-up from 0 (``schedule.warmup_tokens`` and ``inner.warmup_steps``, both
    counted on the swarm's position; the smaller factor wins)."""
    factor = 1.0
    warm_tokens = spec.schedule.warmup_tokens
    if warm_tokens:
        factor = min(factor, (swarm_tokens(spec, round_, step) + tokens_per_swarm_step(spec)) / warm_tokens)
    warm_steps = spec.inner.warmup_steps
    if warm_steps:
        factor = min(factor, (swarm_step(spec, round_, step) + 1) / warm_steps)
    return min(1.0, factor)


def inner_lr(spec: RunSpec, round_: int, step: int) -> float:
    """The inner learning rate at step ``step`` of round ``round_``."""
    tokens = swarm_tokens(spec, round_, step)
    return spec.inner.lr * warmup_factor(spec, round_, step) * decay_factor(spec, tokens)


def outer_lr(spec: RunSpec, round_: int) -> float:
    """The outer learning rate of round ``round_``'s outer step (the schedule's decay at the
    round's end when ``schedule.outer``; no warm-up: DiLoCo's outer step starts at full lr)."""
    if not spec.schedule.outer:
        return spec.outer.lr
    h = spec.rounds.inner_steps or 1
    return spec.outer.lr * decay_factor(spec, swarm_tokens(spec, round_, h - 1))
