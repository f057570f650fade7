"""``peer.node.schedule``: the learning rate by the swarm's position."""

from __future__ import annotations

import math

import pytest

from peer.node.schedule import inner_lr, outer_lr, swarm_tokens, tokens_per_swarm_step
from protocol.errors import SpecError
from protocol.spec import parse_spec
from tests.specs import bare_spec

BASE = bare_spec(
    "sched", lr=1e-3, batch_size=4, inner_steps=10, sections={"data": {"slots": 2}},
)  # fmt: skip


def spec(schedule: str) -> object:
    return parse_spec(BASE + "[schedule]\n" + schedule)


def test_constant_without_a_schedule_is_the_spec_lr_everywhere() -> None:
    s = parse_spec(BASE)
    assert inner_lr(s, 0, 0) == inner_lr(s, 1000, 9) == 1e-3
    assert outer_lr(s, 50) == s.outer.lr


def test_warmup_and_cosine_follow_the_swarm_position_not_the_peer() -> None:
    s = spec("kind = 'cosine'\nwarmup_tokens = 2560\ntotal_tokens = 25600\nmin_lr_ratio = 0.1\nouter = true")
    per_step = tokens_per_swarm_step(s)
    assert per_step == 2 * 4 * 32
    assert swarm_tokens(s, 1, 3) == 13 * per_step
    assert inner_lr(s, 0, 0) == pytest.approx(1e-3 * 1 / 10)  # warm-up: 1 of 10 swarm steps
    assert inner_lr(s, 0, 9) == pytest.approx(1e-3)  # the end of warm-up
    # a late joiner at round 5 gets round 5's rate, whatever it did before
    assert inner_lr(s, 5, 0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 40 / 90))))
    assert inner_lr(s, 10, 0) == pytest.approx(1e-4)  # decayed to the floor at total_tokens
    assert inner_lr(s, 99, 9) == pytest.approx(1e-4)  # and stays there
    assert outer_lr(s, 99) == pytest.approx(0.07)
    assert outer_lr(s, 0) == s.outer.lr  # warm-up is inner only; decay starts after it
    assert outer_lr(s, 3) < s.outer.lr


def test_linear_decay_and_bad_schedules() -> None:
    s = spec("kind = 'linear'\ntotal_tokens = 2560\nmin_lr_ratio = 0.0")
    assert inner_lr(s, 0, 5) == pytest.approx(1e-3 * 0.5)
    with pytest.raises(SpecError, match="needs total_tokens"):
        spec("kind = 'cosine'")
    with pytest.raises(SpecError, match="warmup_tokens .* exceeds total_tokens"):
        spec("kind = 'linear'\nwarmup_tokens = 10\ntotal_tokens = 5")
