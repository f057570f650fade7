"""A landing without overlap in one compiled pass per value (``engine.kernels.land``).

``land_round``'s separate passes read θ_g, the model and the residual for the residual, then θ_g,
the momentum and the average for the outer step, then θ_g again to write the model: about 54
bytes of memory traffic per value. Here each value is read and written once (θ_g, the momentum,
the average, the model, the residual: 32 bytes), with the same operations in the same order, so
the state is the same bits as the reference's (``tests/unit/test_pass_kernels.py`` compares
them over every codec, with and without missing ranges).

It applies where the model lives in host float32 memory, the compiled kernels run and the landing
has no overlap (the model is its own launch point). A round of the sparse codec lands in
``engine.kernels.land_sparse``, which touches only the values the round sent (its mask's
positions in each block): the unsent keep their bits, as the reference's selects leave them
(with overlap, their shift is 0).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import numpy as np
import torch

from engine.compression import Codec, ErrorFeedback, compiled_kernels
from engine.sparse_codec import SparseCodec
from peer.round.state import (
    GlobalState,
    parameter_views,
    read_model_window,
    split_ranges,
    write_model_window,
)
from protocol.spec import OuterSection

WINDOW_VALUES = 1 << 20
"""Values per window (a multiple of every block), cut further where it crosses a parameter
(``_segments``): each piece is landed on its parameter itself, and only a block that straddles
two parameters goes through a buffer. Each piece costs the interpreter a few calls: 1M values
keeps that under 1% of the pass."""
THREAD_VALUES = 1 << 18
"""Values per piece a thread takes within a window (``engine.kernels.run_chunks``)."""

_NO_RESIDUAL = np.empty(0, np.uint16)


def _residual_args(
    feedback: ErrorFeedback | None, codec: Codec | None
) -> tuple[int, float, float, float, float] | None:
    """``engine.kernels.land``'s (or ``land_sparse``'s) residual arguments for this landing, or
    None where it cannot take it in one pass."""
    kernels = compiled_kernels()
    if kernels is None:
        return None
    if codec is not None and not isinstance(codec, SparseCodec) and codec.unsent(0, 1) is not None:
        return None  # values left unsent by a codec without a mask of its own: the passes' work
    if feedback is None or not feedback.codec.lossy:
        return (kernels.LAND_PLAIN, 0.0, 0.0, 0.0, 0.0)
    if isinstance(codec, SparseCodec):
        return codec.sent_residual()
    return (codec or feedback.codec).landing_residual()


def _sent_mask(codec: Codec | None) -> tuple[np.ndarray, int] | None:
    """The positions of each block the round's sparse codec sends, and its block; None for a
    codec that sends every value."""
    if not isinstance(codec, SparseCodec):
        return None
    return codec.positions().numpy(), codec.block


def _on_host(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class _Landing:
    """One fused landing's fixed arguments: the kernel's, where the residual is, and the sparse
    codec's mask where the round sends only part of each block."""

    def __init__(
        self, kernels: ModuleType, residual_args: tuple[int, float, float, float, float], feedback: ErrorFeedback | None,
        config: OuterSection, shift: bool, mask: tuple[np.ndarray, int] | None,
    ) -> None:  # fmt: skip
        self.kernels = kernels
        self.feedback = feedback if feedback is not None and residual_args[0] != kernels.LAND_PLAIN else None
        self.block = feedback.codec.block if feedback is not None else 1
        self.mask = mask
        self.args: tuple[object, ...] = (*residual_args, float(config.lr), float(config.momentum))
        self.args += (bool(config.nesterov), shift)
        if mask is not None:
            self.block = mask[1]
            self.args = (*mask, *self.args)

    def run(self, state: GlobalState, averaged: torch.Tensor, kept: slice, target: torch.Tensor) -> bool:
        """The kernel on ``kept`` (``target``: its model or launch point values); whether a
        residual overflowed."""
        start, n = kept.start, kept.stop - kept.start
        if start % self.block:
            raise ValueError(f"error feedback: a window starts at {start}, not on a block of {self.block}")
        arrays = [x.numpy() for x in (state.params[kept], state.momentum[kept], averaged[kept], target)]
        arrays.append(self.feedback.residual_bits(start, n) if self.feedback is not None else _NO_RESIDUAL)
        land = self.kernels.land if self.mask is None else self.kernels.land_sparse
        return _land_range(self.kernels, land, arrays, self.args)


def _prepare(
    feedback: ErrorFeedback | None, codec: Codec | None, config: OuterSection, shift: bool, *tensors: torch.Tensor
) -> _Landing | None:
    kernels = compiled_kernels()
    residual_args = _residual_args(feedback, codec)
    mask = _sent_mask(codec)
    if kernels is None or residual_args is None or not all(_on_host(t) for t in tensors):
        return None
    return _Landing(kernels, residual_args, feedback, config, shift, mask)


@torch.no_grad()
def land_fused(
    model: torch.nn.Module,
    state: GlobalState,
    averaged: torch.Tensor,
    config: OuterSection,
    *,
    feedback: ErrorFeedback | None,
    missing: Sequence[tuple[int, int]],
    codec: Codec | None,
) -> bool:
    """``land_round`` without overlap (``launch_point=None``) in one pass per value: where the
    group averaged, the residual of what was sent, the outer step on θ_g and the momentum, and
    the model ← θ_g; in the ``missing`` ranges (checked, sorted) nothing changes. False,
    changing nothing, where it does not apply (the caller takes the passes); ``ValueError`` as
    ``ErrorFeedback.update_slice`` for a residual that overflows (the landing then stands
    whole, the residual not finite, as the reference leaves it half done: the peer re-syncs).
    The state's round does not advance."""
    views = list(parameter_views(model))
    landing = _prepare(feedback, codec, config, False, averaged, *(v for _, v in views))
    if landing is None:
        return False
    numel = state.params.numel()
    offsets = [start for start, _ in views]
    buffer: torch.Tensor | None = None
    overflowed = False
    for window in range(0, numel, WINDOW_VALUES):
        for kept in split_ranges(window, min(window + WINDOW_VALUES, numel), missing)[0]:
            for piece, target in _segments(kept, views, offsets, landing.block):
                if target is not None:  # the kernel writes the parameter itself
                    overflowed |= landing.run(state, averaged, piece, target)
                    continue
                n = piece.stop - piece.start
                if buffer is None:  # a block across parameters: through a buffer
                    buffer = torch.empty(landing.block, dtype=torch.float32)
                read_model_window(views, piece.start, buffer[:n], offsets)
                overflowed |= landing.run(state, averaged, piece, buffer[:n])
                write_model_window(views, piece.start, buffer[:n], offsets)
    if overflowed:
        raise ValueError("error feedback: residual overflowed float32")
    return True


def _segments(
    kept: slice, views: Sequence[tuple[int, torch.Tensor]], offsets: Sequence[int], block: int
) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """``kept`` (starting a block) cut where it crosses a parameter: each piece within one
    parameter with that parameter's values, landed in place, and each block that straddles a
    boundary not on a block by itself, with None (it goes through a buffer: its residual is
    one block's). Every piece starts a block, as the residual's windows must."""
    start, stop = kept.start, kept.stop
    while start < stop:
        at, flat = views[max(0, bisect.bisect_right(offsets, start) - 1)]
        end = min(stop, at + flat.numel())
        if end == stop or end % block == 0:
            yield slice(start, end), flat[start - at : end - at]
            start = end
            continue
        straddle = end - end % block
        if straddle > start:
            yield slice(start, straddle), flat[start - at : straddle - at]
        start = min(straddle + block, stop)
        yield slice(straddle, start), None


@torch.no_grad()
def land_global_fused(
    state: GlobalState,
    averaged: torch.Tensor,
    config: OuterSection,
    *,
    feedback: ErrorFeedback | None,
    launch_point: torch.Tensor,
    missing: Sequence[tuple[int, int]],
    codec: Codec | None,
) -> bool:
    """``land_global`` without an eager start in one pass per value: where the group averaged,
    the residual, the outer step and ``launch_point`` ← θ_g_new − launch point (the shift
    ``rebase_model`` adds); in the ``missing`` ranges the shift is 0. False, changing nothing,
    where it does not apply; ``ValueError`` as ``land_fused``."""
    landing = _prepare(feedback, codec, config, True, averaged, launch_point)
    if landing is None:
        return False
    numel = state.params.numel()
    overflowed = False
    for window in range(0, numel, WINDOW_VALUES):
        present, absent = split_ranges(window, min(window + WINDOW_VALUES, numel), missing)
        for kept in present:
            overflowed |= landing.run(state, averaged, kept, launch_point[kept])
        for left in absent:
            launch_point[left].zero_()
    if overflowed:
        raise ValueError("error feedback: residual overflowed float32")
    return True


def _land_range(
    kernels: ModuleType, land: Callable[..., int], arrays: list[np.ndarray], args: tuple[object, ...]
) -> bool:
    """``land`` (``engine.kernels.land`` or ``land_sparse``) over ``arrays`` (θ_g, momentum,
    average, model, residual bits or none), cut for ``run_chunks``'s threads at block
    boundaries; whether a residual overflowed."""
    theta, momentum, averaged, model, residual = arrays

    def run(s: int, e: int) -> int:
        bits = residual[s:e] if residual.size else residual
        return int(land(theta[s:e], momentum[s:e], averaged[s:e], model[s:e], bits, *args))

    return any(kernels.run_chunks(theta.size, THREAD_VALUES, run))
