"""The overlap benchmark's references (``benchmarks.overlap_reference``): each start point is what
its name says, Streaming DiLoCo's landing mixes the model before the landing with θ_g after it,
and the product's functions are back once a run is done, whatever happened in it."""

from __future__ import annotations

import pytest
import torch

from benchmarks.overlap_reference import mixed_landing, overlap_reference, reference_start
from benchmarks.quality_runs import Setup, run_inprocess, run_swarm
from peer.round import host_passes, landing
from peer.round.host_passes import EagerBuffers
from peer.round.state import outer_step_slice
from protocol.spec import OuterSection
from tests.specs import bare_spec

OUTER = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
TINY = bare_spec("tiny", d_model=16, context=8, batch_size=2, inner_steps=3, compression="none", min_group_size=2)


def slices(n: int = 1000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(n, generator=gen) for _ in range(3))  # type: ignore[return-value]


def test_the_global_start_is_the_groups_state_and_moves_nothing() -> None:
    theta, momentum, launch = slices()
    kept = theta.clone(), momentum.clone()
    got = reference_start("global")(theta, momentum, launch, OUTER, EagerBuffers())
    assert torch.equal(got, theta)
    assert torch.equal(theta, kept[0]) and torch.equal(momentum, kept[1])


def test_the_momentum_start_is_the_outer_step_of_the_momentums_mean_and_the_same_in_every_member() -> None:
    theta, momentum, launch = slices()
    want, moment = theta.clone(), momentum.clone()
    outer_step_slice(want, moment, momentum * (1 - OUTER.momentum), OUTER, torch.empty_like(theta))
    got = reference_start("momentum")(theta, momentum, launch, OUTER, EagerBuffers()).clone()
    other = reference_start("momentum")(theta, momentum, launch + 1.0, OUTER, EagerBuffers())
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got, other)  # no member's own Δ in it


def test_the_half_start_lies_between_the_momentum_start_and_the_eager_one_on_plain_outer_sgd() -> None:
    plain = OuterSection(lr=0.7, momentum=0.0, nesterov=False)
    theta, momentum, launch = slices()
    eager = host_passes.eager_point(theta, momentum, launch, plain, EagerBuffers()).clone()
    own = reference_start("momentum")(theta, momentum, launch, plain, EagerBuffers()).clone()
    half = reference_start("half")(theta, momentum, launch, plain, EagerBuffers())
    assert torch.allclose(half, (eager + own) / 2, atol=1e-5)


def test_the_mixed_landing_is_alpha_of_the_model_before_and_the_rest_of_the_new_state() -> None:
    model = torch.nn.Linear(4, 3)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    numel = before.numel()
    state = type("State", (), {"params": torch.full((numel,), 2.0)})()

    def product(model: torch.nn.Module, state: object, averaged: torch.Tensor, config: object, **kw: object) -> None:
        for p in model.parameters():
            p.data.fill_(-100.0)  # whatever the product's landing left: the mix replaces it

    saved = landing.land_round
    landing.land_round = product
    try:
        land = mixed_landing(0.25)
    finally:
        landing.land_round = saved
    land(model, state, torch.zeros(numel), OUTER, launch_point=torch.zeros(numel), keep_progress=True)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.allclose(after, 0.25 * before + 0.75 * 2.0)
    with pytest.raises(ValueError, match="mix"):
        mixed_landing(1.0)


def test_the_products_functions_are_back_after_a_run_even_one_that_failed() -> None:
    saved = host_passes.eager_point, landing.land_round
    with pytest.raises(RuntimeError, match="boom"), overlap_reference("global", 0.5):
        assert host_passes.eager_point is not saved[0] and landing.land_round is not saved[1]
        raise RuntimeError("boom")
    assert (host_passes.eager_point, landing.land_round) == saved
    with pytest.raises(ValueError, match="unknown reference start"):
        reference_start("elsewhere")


def test_an_in_process_run_with_a_reference_start_trains_elsewhere_and_a_real_swarm_refuses_it() -> None:
    eager = {"averaging": {"overlap": True, "overlap_start": "eager"}}
    product = run_inprocess(TINY, Setup("eager", 2, eager, delay_steps=1), seed=3, rounds=3)
    reference = run_inprocess(
        TINY, Setup("global", 2, eager, delay_steps=1, reference_start="global"), seed=3, rounds=3
    )
    assert len(reference.val_loss) == 3 and reference.val_loss != product.val_loss
    assert host_passes.eager_point.__module__ == "peer.round.host_passes"
    with pytest.raises(ValueError, match="in process only"):
        run_swarm(TINY, Setup("global", 2, eager, reference_start="global"), seed=3, rounds=3)
