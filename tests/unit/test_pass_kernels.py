"""The round's host passes with the compiled kernels (``engine.kernels``: the launch's Δ, the
fused error feedback, the outer step) against the same passes on the torch reference
(``SWARMTRAIN_CODEC_KERNELS=off``), bit for bit: the pseudo-gradient sent, the residual kept,
θ_g, the momentum (so the state's digest) and the model, for every codec, with and without
overlap and ranges a failed reducer left out."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from engine.codecs import get_codec
from engine.compression import KERNELS_ENV, ErrorFeedback, compiled_kernels
from peer.round import fused_landing
from peer.round.host_passes import Staging, _sent_outer_step, land_global, land_round, write_pseudo_gradient
from peer.round.state import CHUNK_VALUES, GlobalState, flatten, outer_step
from protocol.spec import OuterSection


@contextmanager
def reference_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch reference for every codec and host pass while inside."""
    monkeypatch.setenv(KERNELS_ENV, "off")
    compiled_kernels.cache_clear()
    try:
        assert compiled_kernels() is None
        yield
    finally:
        monkeypatch.setenv(KERNELS_ENV, "on")
        compiled_kernels.cache_clear()


pytestmark = pytest.mark.usefixtures("compiled_path")


OUTER_STEPS = [
    OuterSection(lr=0.7, momentum=0.9, nesterov=True),
    OuterSection(lr=1.3, momentum=0.37, nesterov=False),
    OuterSection(lr=0.1, momentum=0.0, nesterov=False),
]
"""Nesterov, heavy ball and a plain step: each a branch of the compiled step."""


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def round_on(
    codec_name: str,
    overlap: bool,
    missing: list[tuple[int, int]],
    config: OuterSection = OUTER_STEPS[0],
    error_feedback: bool = True,
) -> dict[str, torch.Tensor | str]:
    """One launch and one landing from fixed seeds; what they left."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(2600, 1700), torch.nn.Linear(5, 1))
    numel = sum(p.numel() for p in model.parameters())
    codec = get_codec(codec_name)
    bound = codec.at_round(4)
    state = GlobalState(flatten(model), torch.randn(numel) * 1e-3, 4)
    feedback = ErrorFeedback(codec, numel) if codec.lossy and error_feedback else None
    if feedback:
        feedback.load_residual(torch.randn(numel) * 1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    out = torch.empty(numel)
    launch_point = torch.empty(numel) if overlap else None
    staging = Staging(model)
    assert write_pseudo_gradient(
        model, state.params, out, feedback=feedback, launch_point=launch_point, staging=staging
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    averaged = torch.randn(numel) * 1e-3
    land_round(
        model, state, averaged, config, feedback=feedback, launch_point=launch_point, keep_progress=overlap,
        staging=staging, missing=missing, codec=bound,
    )  # fmt: skip
    left: dict[str, torch.Tensor | str] = {
        "sent": out,
        "params": state.params,
        "momentum": state.momentum,
        "model": flatten(model),
        "digest": state.digest(),
    }
    if feedback:
        left["residual"] = feedback.state
    return left


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8", "4bit", "sparse"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("with_missing", [False, True])
def test_a_round_lands_the_same_bits_compiled_and_on_the_reference(
    codec_name: str, overlap: bool, with_missing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = max(64, get_codec(codec_name).block)
    missing = [(0, block), (CHUNK_VALUES - 10 * block, CHUNK_VALUES + 20 * block)] if with_missing else []
    compiled = round_on(codec_name, overlap, missing)
    with reference_path(monkeypatch):
        reference = round_on(codec_name, overlap, missing)
    assert compiled.keys() == reference.keys()
    for name, value in compiled.items():
        other = reference[name]
        if isinstance(value, str):
            assert value == other, name
        else:
            assert isinstance(other, torch.Tensor) and torch.equal(bits(value), bits(other)), (codec_name, name)


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8", "sparse"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("config", OUTER_STEPS[1:], ids=["heavy ball", "plain"])
def test_a_round_lands_the_references_bits_with_every_outer_step(
    codec_name: str, overlap: bool, config: OuterSection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused landings choose the outer step's form per value by flags fixed for the loop
    (``engine.kernels._stepped``): a heavy ball and a plain step land the reference's bits too."""
    compiled = round_on(codec_name, overlap, [], config)
    with reference_path(monkeypatch):
        reference = round_on(codec_name, overlap, [], config)
    for name, value in compiled.items():
        other = reference[name]
        assert isinstance(value, str) or torch.equal(bits(value), bits(other)), (codec_name, name)  # type: ignore[arg-type]
        assert not isinstance(value, str) or value == other


@pytest.mark.parametrize("codec_name", ["int8", "sparse"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_without_error_feedback_lands_the_references_bits(
    codec_name: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No residual to keep (``error_feedback = false``): the fused landings' plain kind, and the
    sparse codec's masked one, still land the reference's bits, the unsent values untouched."""
    missing = [(0, 256)]
    compiled = round_on(codec_name, overlap, missing, error_feedback=False)
    with reference_path(monkeypatch):
        reference = round_on(codec_name, overlap, missing, error_feedback=False)
    assert "residual" not in compiled and compiled.keys() == reference.keys()
    for name, value in compiled.items():
        other = reference[name]
        assert isinstance(value, str) or torch.equal(bits(value), bits(other)), (codec_name, name)  # type: ignore[arg-type]
        assert not isinstance(value, str) or value == other


@pytest.mark.parametrize("config", OUTER_STEPS, ids=["nesterov", "heavy ball", "plain"])
def test_the_outer_step_is_the_references_bits(config: OuterSection, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    numel = 3 * CHUNK_VALUES + 11
    start = GlobalState(torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-2, 7)
    averaged = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-30, 30, (numel,), generator=g)
    states = [copy.deepcopy(start), copy.deepcopy(start)]
    outer_step(states[0], averaged, config)
    with reference_path(monkeypatch):
        outer_step(states[1], averaged, config)
    assert torch.equal(bits(states[0].params), bits(states[1].params))
    assert torch.equal(bits(states[0].momentum), bits(states[1].momentum))
    assert states[0].digest() == states[1].digest()


@pytest.mark.parametrize("config", OUTER_STEPS, ids=["nesterov", "heavy ball", "plain"])
def test_the_outer_step_at_the_sent_values_is_the_references_bits(
    config: OuterSection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine.kernels.outer_step_masked`` (the sparse codec's rounds) against the reference's
    step on every value with the unsent ones selected back; NaN and Inf averages included."""
    g = torch.Generator().manual_seed(6)
    numel = 100_003
    theta, momentum = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-2
    averaged = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-30, 30, (numel,), generator=g)
    averaged[::997] = float("nan")
    averaged[5::1009] = float("inf")
    unsent = torch.rand(numel, generator=g) < 0.7
    left = []
    for reference in (False, True):
        t, m = theta.clone(), momentum.clone()
        if reference:
            with reference_path(monkeypatch):
                _sent_outer_step(t, m, averaged, config, torch.empty(numel), unsent)
        else:
            _sent_outer_step(t, m, averaged, config, torch.empty(numel), unsent)
        left.append((t, m))
    (t1, m1), (t2, m2) = left
    assert torch.equal(bits(t1), bits(t2)) and torch.equal(bits(m1), bits(m2))
    assert torch.equal(bits(t1[unsent]), bits(theta[unsent]))  # untouched where unsent


def test_a_residual_that_overflows_bfloat16_is_refused_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 keeps 65504 of a sent 3.4e38: the residual, 3.4e38, is above bfloat16's largest."""
    theta, launched = torch.full((256,), 3.4e38), torch.zeros(256)
    compiled = ErrorFeedback(get_codec("fp16"), 256)
    with pytest.raises(ValueError, match="overflowed"):
        compiled.update_from(theta, launched, 0)
    with reference_path(monkeypatch):
        reference = ErrorFeedback(get_codec("fp16"), 256)
        assert not reference.update_from(theta, launched, 0)  # no fused pass: the caller's passes
        with pytest.raises(ValueError, match="overflowed"):
            reference.update_slice(torch.sub(theta, launched), 0)
    assert torch.equal(bits(compiled.state), bits(reference.state))


@pytest.mark.parametrize("codec_name", ["int8", "4bit"])
@pytest.mark.parametrize(
    ("poison", "refused"), [(1e38, False), (3.3e38, False), (float("nan"), True), (float("inf"), True)]
)
@pytest.mark.parametrize("at", [4096 + 65, 3 * 4096 + 32])  # the second tile's second block; the last, partial block
def test_a_block_residual_near_the_top_of_float32_is_the_references_on_both_paths(
    codec_name: str, poison: float, refused: bool, at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tile whose largest value lies past the bound below which the compiled residual skips
    its check per value (``engine.kernels._residual_bound``) takes the checked loop: huge
    finite values keep the reference's bits, and a NaN or an Inf is refused on both paths (the
    reference's scale guard asserts), in a full block and in the vector's last, partial one."""
    numel = 3 * 4096 + 37
    torch.manual_seed(1)
    theta, launched = torch.randn(numel), torch.randn(numel)
    theta[at], launched[at] = poison, 0.0
    start = torch.randn(numel) * 1e-3

    def residual(kernels: bool) -> torch.Tensor | None:
        feedback = ErrorFeedback(get_codec(codec_name), numel)
        feedback.load_residual(start)
        try:
            if kernels:
                assert feedback.update_from(theta, launched, 0)
            else:
                feedback.update_slice((theta - launched) + start.bfloat16().float(), 0)
        except (ValueError, AssertionError) as refusal:
            assert isinstance(refusal, ValueError) or not kernels
            return None
        return feedback.state.clone()

    compiled = residual(True)
    with reference_path(monkeypatch):
        reference = residual(False)
    if refused:
        assert compiled is None and reference is None
    else:
        assert compiled is not None and reference is not None
        assert torch.equal(bits(compiled), bits(reference))


def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each fused landing's kernel calls from here on: the kernel's name and the values it took."""
    ranges: list[tuple[str, int]] = []
    original = fused_landing._land_range

    def counting(kernels: object, land: Any, arrays: list, args: tuple) -> bool:  # type: ignore[type-arg]
        ranges.append((land.__name__, arrays[0].size))
        return original(kernels, land, arrays, args)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_landing, "_land_range", counting)
    return ranges


@pytest.mark.parametrize(
    ("codec_name", "kernel"),
    [("none", "land"), ("fp16", "land"), ("int8", "land"), ("4bit", "land"), ("sparse", "land_sparse")],
)
def test_a_landing_without_overlap_is_one_pass_per_value_for_every_codec(
    codec_name: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``peer.round.fused_landing``: the residual, the outer step and the model in one kernel
    per window (the round above checks its bits); the sparse codec's in ``land_sparse``, which
    touches the values the round sent only."""
    ranges = kernel_calls(monkeypatch)
    round_on(codec_name, False, [(0, 256)])
    assert {name for name, _ in ranges} == {kernel}
    model = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(2600, 1700), torch.nn.Linear(5, 1))
    assert sum(n for _, n in ranges) == sum(p.numel() for p in model.parameters()) - 256  # every value but the missing


@pytest.mark.parametrize("codec_name", ["fp16", "sparse"])
def test_a_fused_landing_whose_residual_overflows_is_refused_on_both_paths(
    codec_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the separate residual pass: a residual above bfloat16's largest (fp16: a value past
    its range; sparse: a Δ past float32's) raises."""

    def land() -> None:
        model = torch.nn.Linear(16, 16)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.0 if codec_name == "fp16" else -3.4e38)
        numel = sum(p.numel() for p in model.parameters())
        state = GlobalState(torch.full((numel,), 3.4e38), torch.zeros(numel), 0)
        feedback = ErrorFeedback(get_codec(codec_name), numel)
        land_round(
            model, state, torch.zeros(numel), OuterSection(lr=0.7, momentum=0.9, nesterov=True), feedback=feedback,
            launch_point=None, keep_progress=False, staging=Staging(model), codec=get_codec(codec_name).at_round(3),
        )  # fmt: skip

    # the sparse reference refuses the Δ itself, before its residual
    refused = "overflowed" if codec_name == "fp16" else "overflowed|NaN or Inf"
    with pytest.raises(ValueError, match="overflowed"):
        land()
    with reference_path(monkeypatch), pytest.raises(ValueError, match=refused):
        land()


def landed_global(codec_name: str, missing: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """An overlapped round's host half (``land_global``) from fixed seeds; what it left."""
    torch.manual_seed(0)
    numel = fused_landing.WINDOW_VALUES + 100_003  # two windows, the last partial
    codec = get_codec(codec_name)
    state = GlobalState(torch.randn(numel), torch.randn(numel) * 1e-3, 4)
    launch_point = state.params + torch.randn(numel) * 1e-2
    feedback = ErrorFeedback(codec, numel) if codec.lossy else None
    if feedback:
        feedback.load_residual(torch.randn(numel) * 1e-4)
    averaged = torch.randn(numel) * 1e-3
    land_global(
        state, averaged, OuterSection(lr=0.7, momentum=0.9, nesterov=True), feedback=feedback,
        launch_point=launch_point, missing=missing, codec=codec.at_round(4),
    )  # fmt: skip
    left = {"params": state.params, "momentum": state.momentum, "shift": launch_point}
    if feedback:
        left["residual"] = feedback.state
    return left


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8", "4bit", "sparse"])
@pytest.mark.parametrize("with_missing", [False, True])
def test_an_overlapped_rounds_host_half_is_the_references_bits(
    codec_name: str, with_missing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``land_global`` (one pass per value, ``fused_landing.land_global_fused``, where the codec
    sends every value) against the reference's passes: θ_g, the momentum, the shift and the
    residual, bit for bit."""
    block, window = max(64, get_codec(codec_name).block), fused_landing.WINDOW_VALUES
    missing = [(0, block), (window - 10 * block, window + 20 * block)] if with_missing else []
    compiled = landed_global(codec_name, missing)
    with reference_path(monkeypatch):
        reference = landed_global(codec_name, missing)
    assert compiled.keys() == reference.keys()
    for name, value in compiled.items():
        assert torch.equal(bits(value), bits(reference[name])), (codec_name, name)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_non_finite_pseudo_gradient_is_seen_on_both_paths(overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's Δ kernel checks finiteness as it writes (no pass of its own): a NaN or an
    Inf anywhere in the model, or a difference that overflows, is reported as the reference's
    ``all_finite`` reports it."""

    def launch(poison: float, at: int) -> bool:
        model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 7))
        numel = sum(p.numel() for p in model.parameters())
        theta = flatten(model)
        with torch.no_grad():
            model[1].bias[at] = poison
        theta[numel - 7 + at] = -poison if abs(poison) > 1e38 else theta[numel - 7 + at]  # the difference overflows
        feedback = ErrorFeedback(get_codec("fp16"), numel)
        out, launch_point = torch.empty(numel), torch.empty(numel) if overlap else None
        return write_pseudo_gradient(
            model, theta, out, feedback=feedback, launch_point=launch_point, staging=Staging(model)
        )

    cases = [(float("nan"), 0), (float("inf"), 6), (-3.4e38, 3), (0.5, 2)]
    compiled = [launch(poison, at) for poison, at in cases]
    with reference_path(monkeypatch):
        reference = [launch(poison, at) for poison, at in cases]
    assert compiled == reference == [False, False, False, True]


@pytest.mark.parametrize("block", [1, 64, 256])
def test_a_windows_pieces_cover_it_in_place_but_for_blocks_across_parameters(block: int) -> None:
    """``fused_landing._segments``: the pieces cover the window in order, each starts a block,
    each landed in place lies within one parameter, and only a block straddling parameters
    goes through the buffer."""
    sizes = [21, 3, 4096, 1700, 5, 1, 640, 3000]
    views, at = [], 0
    for size in sizes:
        views.append((at, torch.arange(at, at + size, dtype=torch.float32)))
        at += size
    offsets = [start for start, _ in views]
    buffered = 0
    for kept in (slice(0, at), slice(4096, at), slice(0, 4352)):
        cursor = kept.start
        for piece, target in fused_landing._segments(kept, views, offsets, block):
            assert piece.start == cursor and piece.stop > piece.start and piece.start % block == 0
            cursor = piece.stop
            if target is None:
                buffered += 1
                assert piece.stop - piece.start <= block and block > 1
            else:  # the parameter's own values at the piece's place
                assert torch.equal(target, torch.arange(piece.start, piece.stop, dtype=torch.float32))
        assert cursor == kept.stop
    assert (buffered > 0) is (block > 1)


@pytest.mark.parametrize(
    ("codec_name", "kernel"),
    [("none", "land"), ("fp16", "land"), ("int8", "land"), ("4bit", "land"), ("sparse", "land_sparse")],
)
def test_an_overlapped_rounds_host_half_is_one_pass_per_value_for_every_codec(
    codec_name: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``land_global``'s fused path (its bits checked above) is taken for every codec, the
    sparse codec's in ``land_sparse`` with the shift, over every value but the missing."""
    ranges = kernel_calls(monkeypatch)
    landed_global(codec_name, [(4096, 8192)])
    assert {name for name, _ in ranges} == {kernel}
    assert sum(n for _, n in ranges) == fused_landing.WINDOW_VALUES + 100_003 - 4096
