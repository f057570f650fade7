"""The reducer's robust mean (``engine.robust``): bounded weights and norms, named offenders."""

from __future__ import annotations

import pytest
import torch

from engine.robust import (
    DEFAULT_MAX_WEIGHT,
    HONEST_SPAN_S,
    Alignment,
    RobustRule,
    direction_offence,
    lower_median,
    robust_mean,
)
from protocol.spec import AveragingSection, CreditsSection

RULE = RobustRule(clip=1.0, weight_cap=2.0, flag=3.0)
OFF = RobustRule.off()


def clipped_mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """What ``RULE`` should give when nobody is left out: every part scaled to at most the
    lower median norm, weights as given (already capped)."""
    median = lower_median([float(p.norm()) for p in parts])
    total = sum(w * p * min(1.0, median / float(p.norm())) for p, w in zip(parts, weights))
    return total / sum(weights)


def honest(count: int, numel: int = 1000) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=generator)
    return [base + 0.1 * torch.randn(numel, generator=generator) for _ in range(count)]


def test_honest_members_are_clipped_to_the_median_norm_and_named_nowhere() -> None:
    parts = honest(4)
    weights = [10.0, 20.0, 30.0, 40.0]
    reduced = robust_mean(parts, weights, RULE)
    mean, offences = reduced.mean, reduced.offences
    plain = sum(p * w for p, w in zip(parts, weights)) / sum(weights)
    assert offences == {}
    assert torch.allclose(mean, clipped_mean(parts, weights), atol=1e-6)
    assert float((mean - plain).norm()) < 0.05 * float(plain.norm())  # honest norms are close
    off = robust_mean(parts, weights, OFF).mean
    assert torch.allclose(off, plain, atol=1e-6)


def test_a_scaled_part_is_clipped_to_the_bound_and_named() -> None:
    parts = honest(4)
    parts[2] = parts[2] * 100
    reduced = robust_mean(parts, [1.0] * 4, RULE)
    mean, offences = reduced.mean, reduced.offences
    assert list(offences) == [2] and "is over 3x the group's median" in offences[2] and "(left out)" in offences[2]
    median = lower_median([float(p.norm()) for p in parts])  # the medians include the named one
    kept = [parts[0], parts[1], parts[3]]
    expected = sum(p * min(1.0, median / float(p.norm())) for p in kept) / 3
    assert torch.allclose(mean, expected, atol=1e-6)
    assert float(mean.norm()) <= float(honest(4)[0].norm()) * 1.05


def test_a_huge_self_reported_weight_is_capped_and_named() -> None:
    parts = honest(4)
    reduced = robust_mean(parts, [100.0, 100.0, 1e15, 100.0], RULE)
    mean, offences = reduced.mean, reduced.offences
    assert list(offences) == [2] and f"is over {DEFAULT_MAX_WEIGHT:.4g}, more than a member can have" in offences[2]
    median = lower_median([float(p.norm()) for p in parts])  # the medians include the named one
    expected = sum(p * min(1.0, median / float(p.norm())) for p in (parts[0], parts[1], parts[3])) / 3
    assert torch.allclose(mean, expected, atol=1e-6)


def test_a_weight_within_flag_times_the_cap_is_capped_but_not_named() -> None:
    offences = robust_mean(honest(4), [100.0, 100.0, 500.0, 100.0], RULE).offences
    assert offences == {}


def test_an_honest_heavy_member_beside_newcomers_is_capped_not_named() -> None:
    """The soak's false accusation: a member whose last rounds failed brought 3,352 samples
    to a round where a newcomer brought 144 (and others 0): 23x the median is honest churn (or
    a datacenter GPU beside a laptop), capped to bound its influence, never named (a named
    member is left out and denied its credit)."""
    parts = honest(5)
    weights = [144.0, 0.0, 0.0, 3352.0, 0.0]
    reduced = robust_mean(parts, weights, RobustRule())
    assert reduced.offences == {}
    capped = robust_mean(parts, [144.0, 0.0, 0.0, 288.0, 0.0], RobustRule()).mean
    assert torch.allclose(reduced.mean, capped, atol=1e-6)  # weighed as 2x the median, no more


def test_the_weight_bound_follows_the_runs_credited_rate() -> None:
    rule = RobustRule.for_spec(AveragingSection(), CreditsSection(max_samples_per_second=50.0))
    assert rule.max_weight == 50.0 * HONEST_SPAN_S
    weights = [100.0, 100.0, 50.0 * HONEST_SPAN_S + 1, 100.0]
    assert list(robust_mean(honest(4), weights, rule).offences) == [2]
    assert RobustRule.off().max_weight == float("inf")  # the plain mean names nobody


def test_members_that_count_nothing_set_no_median() -> None:
    """Stale members (weight 0) and members with no samples (~1e-12) send zeros or anything:
    they neither count nor pull the median norm down to clip the honest ones."""
    parts = honest(2) + [torch.zeros(1000), torch.full((1000,), 1e6)]
    reduced = robust_mean(parts, [1.0, 1.0, 1e-12, 0.0], RULE)
    mean, offences = reduced.mean, reduced.offences
    assert offences == {}
    assert torch.allclose(mean, clipped_mean(parts[:2], [1.0, 1.0]), atol=1e-6)


def test_nobody_contributing_gives_zeros() -> None:
    reduced = robust_mean([torch.ones(5), torch.ones(5)], [0.0, 1e-12], RULE)
    mean, offences = reduced.mean, reduced.offences
    assert torch.equal(mean, torch.zeros(5)) and offences == {}


def test_in_a_group_of_two_the_smaller_member_bounds_both() -> None:
    parts = honest(2)
    parts[1] = parts[1] * 50
    reduced = robust_mean(parts, [1.0, 1.0], RULE)
    mean, offences = reduced.mean, reduced.offences
    assert list(offences) == [1]
    assert float(mean.norm()) <= 2.0 * float(parts[0].norm()) + 1e-3


def test_a_median_norm_of_zero_clips_nothing() -> None:
    parts = [torch.zeros(10), torch.zeros(10), torch.ones(10)]
    reduced = robust_mean(parts, [1.0, 1.0, 1.0], RobustRule(min_cosine=-1))
    mean, offences = reduced.mean, reduced.offences
    assert offences == {} and torch.allclose(mean, torch.full((10,), 1 / 3))


def test_integer_means_stay_exact() -> None:
    """Sums first, one division: small integers average exactly (the all-reduce tests rely on it)."""
    parts = [torch.full((7,), float(v)) for v in (1, 2, 3)]
    mean = robust_mean(parts, [1.0, 1.0, 1.0], OFF).mean
    assert torch.equal(mean, torch.full((7,), 2.0))


def test_off_means_the_plain_weighted_mean() -> None:
    parts = honest(3)
    parts[0] = parts[0] * 100
    reduced = robust_mean(parts, [1.0, 1e9, 1.0], OFF)
    mean, offences = reduced.mean, reduced.offences
    assert offences == {}
    assert torch.allclose(mean, (parts[0] + 1e9 * parts[1] + parts[2]) / (2 + 1e9), atol=1e-5)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="0 \\(off\\) or >= 1"):
        RobustRule(clip=0.5)
    with pytest.raises(ValueError, match="one weight per part"):
        robust_mean([torch.ones(2)], [1.0, 1.0], RULE)
    with pytest.raises(ValueError, match="median of nothing"):
        lower_median([])


def test_lower_median() -> None:
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert lower_median([5.0]) == 5.0


def test_a_sign_flipped_part_is_left_out_and_its_member_named_over_the_round() -> None:
    parts = honest(4)
    parts[1] = -parts[1]
    reduced = robust_mean(parts, [1.0] * 4, RULE)
    assert reduced.offences == {}  # a part alone names nobody for its direction
    assert reduced.alignment[1].left_out == 1 and all(reduced.alignment[i].left_out == 0 for i in (0, 2, 3))
    kept = [parts[0], parts[2], parts[3]]
    median = lower_median([float(p.norm()) for p in parts])  # the medians include the flipped one
    expected = sum(p * min(1.0, median / float(p.norm())) for p in kept) / 3
    assert torch.allclose(reduced.mean, expected, atol=1e-6)
    pooled = Alignment()
    for _ in range(3):
        pooled.add(robust_mean(parts, [1.0] * 4, RULE).alignment[1])
    assert "point against the others'" in direction_offence(pooled, RULE) and "over 3 parts; 3 left out" in (
        direction_offence(pooled, RULE)
    )
    assert direction_offence(reduced.alignment[0], RULE) == ""


def test_a_slightly_negative_part_is_kept_and_a_mostly_aligned_member_not_named() -> None:
    """Honest parts dip below 0 now and then (measured down to -0.26): kept, and pooled over
    the round the member's direction agrees with the others'."""
    seen = Alignment(dot=-0.2, mine_sq=1.0, others_sq=1.0, parts=1)
    assert direction_offence(seen, RULE) != ""
    seen.add(Alignment(dot=0.8, mine_sq=1.0, others_sq=1.0, parts=1))
    assert direction_offence(seen, RULE) == ""


def test_direction_is_not_judged_between_two_members() -> None:
    parts = honest(2)
    parts[1] = -parts[1]
    reduced = robust_mean(parts, [1.0, 1.0], RULE)
    assert reduced.offences == {} and reduced.alignment == {}
    assert torch.allclose(reduced.mean, clipped_mean(parts, [1.0, 1.0]), atol=1e-6)


def test_direction_off() -> None:
    parts = honest(3)
    parts[0] = -parts[0]
    reduced = robust_mean(parts, [1.0] * 3, RobustRule(leave_out_cosine=-1, min_cosine=-1))
    assert reduced.alignment == {}
    with pytest.raises(ValueError, match="min_cosine"):
        RobustRule(min_cosine=2)
    with pytest.raises(ValueError, match="leave_out_cosine"):
        RobustRule(leave_out_cosine=-2)
    with pytest.raises(ValueError, match="flag"):
        RobustRule(flag=0.5)
