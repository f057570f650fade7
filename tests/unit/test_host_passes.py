"""The chunked, in-place host passes give the very bytes of the whole-vector formulas they
replace (launch: Δ + residual; landing: residual, outer step, re-basing)."""

from __future__ import annotations

import pytest
import torch

from engine.codecs import get_codec
from engine.compression import RESIDUAL_DTYPE, ErrorFeedback
from peer.round.host_passes import Staging, land_round, start_eagerly, undo_eager_start, write_pseudo_gradient
from peer.round.state import CHUNK_VALUES, GlobalState, flatten, load_flat, outer_step
from protocol.spec import OuterSection


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # one parameter larger than a chunk (split inside it), small ones around it
    return torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(2600, 1700), torch.nn.Linear(5, 1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == RESIDUAL_DTYPE else torch.int32)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded as ``ErrorFeedback`` stores a residual."""
    return t.to(RESIDUAL_DTYPE)


def _missing(numel: int, block: int = 64) -> list[tuple[int, int]]:
    """Ranges a failed reducer leaves out, aligned to the codec's blocks as reducers' ranges
    are: at the start, across a chunk and a parameter boundary, and at the end."""
    return [
        (0, block),
        (CHUNK_VALUES - 10 * block, CHUNK_VALUES + 20 * block),
        (numel - numel % block - 2 * block, numel),
    ]


@pytest.mark.parametrize(
    ("codec_name", "overlap", "with_missing"),
    [
        ("4bit", False, False),
        ("4bit", True, False),
        ("fp16", True, False),
        ("none", False, False),
        ("none", True, False),
        ("4bit", False, True),
        ("4bit", True, True),
        ("none", False, True),
        ("sparse", False, False),
        ("sparse", True, True),
    ],
)
def test_launch_and_landing_match_the_whole_vector_formulas(overlap: bool, codec_name: str, with_missing: bool) -> None:
    """With ``with_missing``, ranges a failed reducer left out land like a failed round: θ_g, the
    momentum, the residual and θ_local keep their values there; the rest is the formulas'. So do
    the values the ``sparse`` codec did not send this round (``Codec.unsent``)."""
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    missing = _missing(numel, max(64, get_codec(codec_name).block)) if with_missing else []
    left_out = torch.zeros(numel, dtype=torch.bool)
    for lo, hi in missing:
        left_out[lo:hi] = True
    assert any(p.numel() > CHUNK_VALUES for p in model.parameters())
    codec = get_codec(codec_name)
    bound = codec.at_round(4)  # the round landed: the sparse codec's mask is its
    unsent = bound.unsent(0, numel)
    if unsent is not None:
        left_out |= unsent
    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    state = GlobalState(flatten(model), torch.randn(numel) * 1e-3, 4)
    feedback = ErrorFeedback(codec, numel) if codec.lossy else None
    # as the feedback stores it (``RESIDUAL_DTYPE``), so that the launch's sum is the formula's
    old_residual = _stored(torch.randn(numel) * 1e-4) if feedback else torch.zeros(numel)
    if feedback:
        feedback.load_residual(old_residual)
    with torch.no_grad():  # the inner steps
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    local = flatten(model)
    theta, momentum = state.params.clone(), state.momentum.clone()

    out = torch.full((numel,), float("nan"))
    launch_point = torch.empty(numel) if overlap else None
    staging = Staging(model)
    assert write_pseudo_gradient(
        model, state.params, out, feedback=feedback, launch_point=launch_point, staging=staging
    )
    sent = torch.add(torch.sub(theta, local), old_residual) if feedback else torch.sub(theta, local)
    assert torch.equal(_bits(out), _bits(sent))
    if launch_point is not None:
        assert torch.equal(launch_point, local)
        with torch.no_grad():  # the next round's inner steps while this one averages
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
    now = flatten(model)

    averaged = torch.randn(numel) * 1e-3
    land_round(
        model,
        state,
        averaged,
        config,
        feedback=feedback,
        launch_point=launch_point,
        keep_progress=overlap,
        staging=staging,
        missing=missing,
        codec=bound,
    )
    lr, mu = torch.tensor(config.lr), torch.tensor(config.momentum)
    new_momentum = torch.add(torch.mul(momentum, mu), averaged)
    update = torch.add(averaged, torch.mul(new_momentum, mu))
    new_theta = torch.sub(theta, torch.mul(update, lr))
    expected_local = torch.add(new_theta, torch.sub(now, local)) if overlap else new_theta.clone()
    expected_residual = _stored(torch.sub(sent, bound.decode(bound.encode(sent), numel))) if feedback else None
    # left out: nothing moves but the local model's own progress
    new_momentum[left_out], new_theta[left_out], expected_local[left_out] = (
        momentum[left_out],
        theta[left_out],
        now[left_out],
    )
    if expected_residual is not None:
        expected_residual[left_out] = old_residual[left_out]
    assert state.round == 5
    assert torch.equal(_bits(state.momentum), _bits(new_momentum))
    assert torch.equal(_bits(state.params), _bits(new_theta))
    assert torch.equal(_bits(flatten(model)), _bits(expected_local))
    if feedback:
        assert expected_residual is not None
        assert torch.equal(_bits(feedback.state), _bits(expected_residual))


def _launched(round_: int) -> tuple[torch.nn.Module, GlobalState, torch.Tensor, torch.Tensor, Staging]:
    """A model at θ_g of round ``round_`` plus some local work, whose round was just launched
    (no overlap residual): the model, the state, θ_local, the launch point and the staging."""
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    state = GlobalState(flatten(model), torch.randn(numel) * 1e-3, round_)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    launch_point, staging = torch.empty(numel), Staging(model)
    write_pseudo_gradient(
        model, state.params, torch.empty(numel), feedback=None, launch_point=launch_point, staging=staging
    )
    return model, state, flatten(model), launch_point, staging


@pytest.mark.parametrize("with_missing", [False, True])
def test_an_eager_start_is_the_outer_step_on_the_peers_own_delta_and_lands_from_there(with_missing: bool) -> None:
    """Overlap with ``overlap_start = "eager"``: the next inner phase starts at θ̂ = θ_g after
    an outer step on this peer's own Δ (θ_g and the momentum untouched); at landing the
    progress since θ̂ is re-based onto the new θ_g, and in left-out ranges θ_local is its own
    work from the launch point (the eager jump taken back)."""
    model, state, local, launch_point, staging = _launched(round_=2)
    numel = local.numel()
    missing = _missing(numel) if with_missing else []
    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    theta, momentum = state.params.clone(), state.momentum.clone()
    start_eagerly(model, state, launch_point, config, staging)
    expected = GlobalState(theta.clone(), momentum.clone(), 2)
    outer_step(expected, torch.sub(theta, local), config)
    assert torch.equal(_bits(flatten(model)), _bits(expected.params))
    assert torch.equal(state.params, theta) and torch.equal(state.momentum, momentum)
    with torch.no_grad():  # inner steps from θ̂ while the round averages
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    now = flatten(model)
    progress = torch.sub(now, expected.params)
    averaged = torch.randn(numel) * 1e-3
    land_round(
        model,
        state,
        averaged,
        config,
        feedback=None,
        launch_point=launch_point,
        keep_progress=True,
        staging=staging,
        missing=missing,
        eager=True,
    )
    landed = flatten(model)
    want = torch.add(state.params, progress)
    for lo, hi in missing:
        want[lo:hi] = torch.add(local[lo:hi], progress[lo:hi])
    assert torch.allclose(landed, want, atol=1e-6)
    assert not with_missing or torch.equal(state.params[:64], theta[:64])


def test_a_round_that_does_not_land_takes_the_eager_start_back() -> None:
    model, state, local, launch_point, staging = _launched(round_=0)
    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    start_eagerly(model, state, launch_point, config, staging)
    assert not torch.equal(flatten(model), local)
    undo_eager_start(model, state, launch_point, config, staging)
    assert torch.equal(_bits(flatten(model)), _bits(local))  # no progress since: exactly the launch point


def test_missing_ranges_that_overlap_or_leave_the_vector_are_refused_before_anything_changes() -> None:
    model = _model()
    state = GlobalState(flatten(model), torch.zeros(flatten(model).numel()), 1)
    before = state.params.clone()
    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    for bad in ([(0, 128), (64, 256)], [(10, 10)], [(0, state.params.numel() + 64)], [(-64, 64)]):
        with pytest.raises(ValueError, match="missing ranges"):
            land_round(
                model,
                state,
                torch.ones_like(before),
                config,
                feedback=None,
                launch_point=None,
                keep_progress=False,
                staging=Staging(model),
                missing=bad,
            )
    assert state.round == 1 and torch.equal(state.params, before)


def test_a_non_finite_model_is_reported_at_launch() -> None:
    model = _model()
    state = GlobalState.from_model(model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[2] = float("nan")
    out = torch.empty_like(state.params)
    assert not write_pseudo_gradient(model, state.params, out, feedback=None, launch_point=None, staging=Staging(model))


def test_load_flat_and_flatten_round_trip_across_chunks() -> None:
    model = _model()
    values = torch.randn(sum(p.numel() for p in model.parameters()))
    load_flat(model, values)
    assert torch.equal(flatten(model), values)


def test_a_background_digest_equals_the_computed_one_and_is_dropped_when_the_state_changes() -> None:
    from protocol.statesync import state_digest

    state = GlobalState(torch.randn(2_000_000), torch.randn(2_000_000), 3)
    expected = state_digest(3, state.params, state.momentum)
    state.start_digest()
    state.wait_for_digest()
    assert state.digest_ready() and state.digest() == expected and state.digest_s > 0
    state.round = 4  # a new state: the cached digest is forgotten
    assert not state.digest_ready()
    state.start_digest()
    state.params = state.params.clone()  # assigned while hashing: that hash is abandoned
    assert state.digest() == state_digest(4, state.params, state.momentum)


def test_parameters_outside_host_float32_go_through_the_staging_buffer() -> None:
    """(What an accelerator's parameters do; here bfloat16 parameters on the CPU.)"""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 3)).to(torch.bfloat16)
    staging = Staging(model)
    assert staging.buffer is not None
    theta = flatten(model)
    state = GlobalState(theta.clone(), torch.zeros_like(theta), 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    local = flatten(model)
    out = torch.empty_like(theta)
    feedback = ErrorFeedback(get_codec("int8"), theta.numel())
    assert write_pseudo_gradient(model, state.params, out, feedback=feedback, launch_point=None, staging=staging)
    assert torch.equal(out, torch.sub(theta, local))  # (no residual yet)
    averaged = torch.randn_like(theta) * 1e-3
    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    land_round(
        model, state, averaged, config, feedback=feedback, launch_point=None, keep_progress=False, staging=staging
    )
    assert torch.equal(flatten(model), state.params.to(torch.bfloat16).float())
    assert bool(feedback.state.any())


@pytest.mark.parametrize(
    ("codec_name", "eager", "with_missing"),
    [
        ("4bit", False, False),
        ("none", False, False),
        ("4bit", True, False),
        ("4bit", False, True),
        ("none", True, True),
        ("sparse", False, True),
        ("sparse", True, False),
    ],
)
def test_landing_in_two_halves_gives_the_global_state_of_land_round_bit_for_bit(
    codec_name: str, eager: bool, with_missing: bool
) -> None:
    """``land_global`` (host state only, the landing thread) then ``rebase_model`` (between two
    inner steps): θ_g, the momentum and the residual are land_round's very bytes; the model
    its value to float rounding (θ_local + (θ_g_new − start) instead of (θ_local − start) + θ_g_new)."""
    from peer.round.host_passes import land_global, rebase_model

    config = OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    codec = get_codec(codec_name)
    landed = []
    for halves in (False, True):
        model, state, _, launch_point, staging = _launched(round_=3)
        numel = launch_point.numel()
        missing = _missing(numel, max(64, codec.block)) if with_missing else []
        feedback = ErrorFeedback(codec, numel) if codec.lossy else None
        if feedback:
            feedback.load_residual(torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-4)
        if eager:
            start_eagerly(model, state, launch_point, config, staging)
        with torch.no_grad():  # the next round's inner steps while this one averages
            gen = torch.Generator().manual_seed(2)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        averaged = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e-3
        common = {
            "feedback": feedback,
            "launch_point": launch_point,
            "missing": missing,
            "eager": eager,
            "codec": codec.at_round(3),
        }
        if halves:
            land_global(state, averaged, config, **common)
            assert state.round == 3  # advanced by the caller once the model is re-based
            rebase_model(model, launch_point)
            state.round += 1
        else:
            land_round(model, state, averaged, config, keep_progress=True, staging=staging, **common)
        landed.append((state, flatten(model), feedback.state.clone() if feedback else None))
    (one, model_one, residual_one), (two, model_two, residual_two) = landed
    assert one.round == two.round == 4
    assert torch.equal(_bits(one.params), _bits(two.params))
    assert torch.equal(_bits(one.momentum), _bits(two.momentum))
    if residual_one is not None:
        assert residual_two is not None and torch.equal(_bits(residual_one), _bits(residual_two))
    torch.testing.assert_close(model_two, model_one, rtol=0, atol=1e-6)
