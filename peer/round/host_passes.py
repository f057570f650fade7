"""The peer's host-side work per round, as a few chunked passes over the state.

No pass allocates anything the size of the model: each walks the model's parameters in
``flatten`` order (``peer.round.state.model_pieces``) and the flat vectors (θ_g, outer momentum,
the averager's shared vector, the codec residual, the launch point) slice by slice, with
buffers of one chunk. Fresh full-size temporaries cost more than the arithmetic (every page
of a new tensor is faulted in and zeroed: ~0.4 s per GB here, against ~0.05 s per GB for an
in-place pass), and they set the peak memory.

- ``write_pseudo_gradient`` (launch): the averager's vector ← θ_g − θ_local (+ the codec
  residual), and, with overlap, the launch point ← θ_local; with overlap the trainer cuts it in
  two: ``copy_model_into`` (the launch point, on the training thread) and ``write_delta_from``
  (the vector from the launch point, on the landing thread);
- ``start_eagerly`` (launch, overlap with ``overlap_start = "eager"``): θ_local ← θ̂, the
  outer step θ_g would take if the group's average were this peer's own Δ (``eager_point``);
  ``undo_eager_start`` takes it back for a round that did not land;
- ``land_round`` (a successful round): the codec residual of what was sent (error feedback,
  recomputed here from θ_g, the launch point and the old residual, so a failed round needs
  nothing restored; in windows aligned like the wire's blocks), then per slice the outer
  step in place and θ_local ← θ_g (+ the progress made since the launch, with overlap: from
  the launch point, or from θ̂ after an eager start).
  Ranges the group could not average (a reducer failed: ``missing``) land like a failed
  round: θ_g, the momentum and the residual keep their values there and θ_local keeps its
  own, so this peer's work there folds into the next round.
- ``roll_forward`` (a newcomer): the state of round r to that of r + 1 by the round's averaged
  update as a member kept it (``engine.update_store``): the outer step of ``land_round`` on θ_g
  and the momentum alone, the same bytes.
- ``land_global`` + ``rebase_model`` (a successful round, with overlap): the same landing cut in
  two. ``land_global`` touches host state only (the residual, the outer step on θ_g and the
  momentum) and turns the launch point, which it no longer needs, into the shift
  θ_local_new − θ_local (the same for any θ_local: θ_g_new minus the start point), so it runs
  on a thread of its own while the inner steps go on; ``rebase_model`` then adds the shift to
  the model between two inner steps, the only part that touches the model.

Parameters on an accelerator are staged through one pinned host buffer of a chunk.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from engine.compression import Codec, ErrorFeedback, all_finite, compiled_kernels
from peer.round.fused_landing import land_fused, land_global_fused
from peer.round.state import (
    CHUNK_VALUES,
    GlobalState,
    Ranges,
    chunks,
    model_pieces,
    outer_step_slice,
    parameter_views,
    read_model_window,
    split_ranges,
)
from protocol.spec import OuterSection
from protocol.updates import FetchedUpdate


def check_ranges(missing: Ranges, numel: int) -> list[tuple[int, int]]:
    """``missing`` as sorted, disjoint, non-empty ranges within ``[0, numel)``; ``ValueError`` otherwise."""
    ranges = sorted((int(lo), int(hi)) for lo, hi in missing)
    cursor = 0
    for lo, hi in ranges:
        if not (cursor <= lo < hi <= numel):
            raise ValueError(f"missing ranges must be disjoint, non-empty and within [0, {numel}): {ranges}")
        cursor = hi
    return ranges


def model_is_finite(model: torch.nn.Module) -> bool:
    return all(all_finite(p.detach()) for p in model.parameters())


class Staging:
    """Host copies of parameter slices that do not live in host float32 memory."""

    def __init__(self, model: torch.nn.Module) -> None:
        on_host = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
        pin = torch.cuda.is_available() and not on_host
        self.buffer = (
            None if on_host else torch.empty(CHUNK_VALUES, dtype=torch.float32, pin_memory=pin)  # one chunk
        )

    def host(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` as host float32 values: the view itself when it is one, else a staged copy
        (valid until the next call)."""
        if self.buffer is None:
            return piece
        staged = self.buffer[: piece.numel()]
        staged.copy_(piece)
        return staged


@torch.no_grad()
def copy_model_into(model: torch.nn.Module, out: torch.Tensor) -> None:
    """``out`` ← θ_local (flat, as ``flatten`` lays it out), one copy per parameter (from an
    accelerator one transfer each: a chunk per transfer would pay its fixed cost ~10,000 times
    per GB)."""
    for offset, values in parameter_views(model):
        out[offset : offset + values.numel()].copy_(values)


@torch.no_grad()
def write_pseudo_gradient(
    model: torch.nn.Module,
    theta: torch.Tensor,
    out: torch.Tensor,
    *,
    feedback: ErrorFeedback | None,
    launch_point: torch.Tensor | None,
    staging: Staging,
) -> bool:
    """``out`` ← θ_g − θ_local (+ residual); ``launch_point`` ← θ_local when given. Whether
    ``out`` is finite. A model on an accelerator with a launch point is copied into it first,
    one transfer per parameter, and the rest are host passes over the launch point."""
    if launch_point is not None and staging.buffer is not None:
        copy_model_into(model, launch_point)
        return write_delta_from(launch_point, theta, out, feedback=feedback)
    kernels = compiled_kernels()
    if kernels is not None and staging.buffer is None:
        # one compiled pass per parameter, the finiteness check inside it
        finite = True
        for offset, values in parameter_views(model):
            part = slice(offset, offset + values.numel())
            finite &= _delta(kernels, theta[part], values, out[part], feedback, offset)
            if launch_point is not None:
                launch_point[part].copy_(values)
        return finite
    for offset, piece in model_pieces(model):
        local = staging.host(piece)
        part = slice(offset, offset + local.numel())
        sent = out[part]
        torch.sub(theta[part], local, out=sent)
        if feedback is not None:
            feedback.add_into(sent, offset)
        if launch_point is not None:
            launch_point[part].copy_(local)
    return all_finite(out)


def _delta(
    kernels: ModuleType, theta: torch.Tensor, launched: torch.Tensor, out: torch.Tensor,
    feedback: ErrorFeedback | None, offset: int,
) -> bool:  # fmt: skip
    """``engine.kernels.delta`` on one range, on ``run_chunks``'s threads; whether ``out`` is finite there."""
    residual = feedback.residual_bits(offset, out.numel()) if feedback is not None else _NO_RESIDUAL
    t, base, sent = theta.numpy(), launched.detach().numpy(), out.numpy()

    def run(s: int, e: int) -> int:
        return int(kernels.delta(t[s:e], base[s:e], residual[s:e] if residual.size else residual, sent[s:e]))

    return not any(kernels.run_chunks(out.numel(), DELTA_THREAD_VALUES, run))


@torch.no_grad()
def write_delta_from(
    launch_point: torch.Tensor, theta: torch.Tensor, out: torch.Tensor, *, feedback: ErrorFeedback | None
) -> bool:
    """``out`` ← θ_g − launch point (+ residual), chunk by chunk, touching no model (with
    overlap the landing thread runs it while the next inner steps go on). Whether ``out`` is
    finite."""
    kernels = compiled_kernels()
    if kernels is not None:  # the same two operations in one pass, the finiteness check inside it
        return _delta(kernels, theta, launch_point, out, feedback, 0)
    for part in chunks(theta.numel()):
        sent = out[part]
        torch.sub(theta[part], launch_point[part], out=sent)
        if feedback is not None:
            feedback.add_into(sent, part.start)
    return all_finite(out)


@torch.no_grad()
def update_residual(
    model: torch.nn.Module,
    theta: torch.Tensor,
    feedback: ErrorFeedback,
    launch_point: torch.Tensor | None,
    staging: Staging,
    missing: Ranges = (),
    *,
    codec: Codec | None = None,
) -> None:
    """The codec residual of what this peer sent: sent = θ_g − launch point + old residual
    (exactly the launch's bytes: θ_g, the launch point and the residual have not changed since),
    residual ← sent − decode(encode(sent)). Windows start at multiples of the codec's block
    from the start of the vector, like the parts on the wire, so the residual is exactly what
    the wire dropped. In ``missing`` ranges (block-aligned: reducers' ranges are) the residual
    keeps its value: nothing sent there counted. ``codec``: the feedback's codec as the round
    used it (``Codec.at_round``: its wire format may depend on the round); so do the values it
    did not send at all (``Codec.unsent``)."""
    codec = codec or feedback.codec
    if feedback.codec.block == 1 and launch_point is None:
        # a codec of single values: any cut is aligned, read the parameters where they are
        for offset, piece in model_pieces(model):
            local = staging.host(piece)
            part = slice(offset, offset + local.numel())
            sent: torch.Tensor | None = None
            for kept in split_ranges(part.start, part.stop, missing)[0]:
                if feedback.update_from(
                    theta[kept], local[kept.start - offset : kept.stop - offset], kept.start, codec
                ):
                    continue  # one compiled pass, the same bits
                if sent is None:
                    sent = torch.sub(theta[part], local)
                window = sent[kept.start - offset : kept.stop - offset]
                feedback.add_into(window, kept.start)
                feedback.update_slice(window, kept.start, codec)
        return
    size = CHUNK_VALUES - CHUNK_VALUES % feedback.codec.block
    views = list(parameter_views(model)) if launch_point is None else []
    offsets = [offset for offset, _ in views]
    sent_buffer = torch.empty(size, dtype=torch.float32)
    model_buffer = torch.empty(size, dtype=torch.float32) if launch_point is None else None
    for part in chunks(theta.numel(), size):
        n = part.stop - part.start
        if launch_point is None:
            assert model_buffer is not None
            launched = model_buffer[:n]
            read_model_window(views, part.start, launched, offsets)
        else:
            launched = launch_point[part]
        sent = sent_buffer[:n]
        subtracted = False
        for kept in split_ranges(part.start, part.stop, missing)[0]:
            within = slice(kept.start - part.start, kept.stop - part.start)
            if feedback.update_from(theta[kept], launched[within], kept.start, codec):
                continue  # one compiled pass, the same bits
            if not subtracted:
                torch.sub(theta[part], launched, out=sent)
                subtracted = True
            window = sent[within]
            feedback.add_into(window, kept.start)
            feedback.update_slice(window, kept.start, codec)


class EagerBuffers:
    """Chunk buffers of ``eager_point``: θ̂, a copy of the momentum, Δ and the step's scratch."""

    def __init__(self) -> None:
        self.values = torch.empty(4, CHUNK_VALUES, dtype=torch.float32)


@torch.no_grad()
def eager_point(
    theta: torch.Tensor, momentum: torch.Tensor, launch: torch.Tensor, config: OuterSection, buffers: EagerBuffers
) -> torch.Tensor:
    """θ̂ of one slice (at most a chunk): where θ_g would go if the group's average were this
    peer's own Δ = θ_g − launch point (the outer step, momentum included, on copies: θ_g and
    the momentum are untouched). A pure function of θ_g, the momentum and the launch point, so
    the landing recomputes it instead of keeping a copy. Valid until the next call."""
    n = theta.numel()
    out, moment, delta, scratch = (row[:n] for row in buffers.values)
    torch.sub(theta, launch, out=delta)
    moment.copy_(momentum)
    out.copy_(theta)
    outer_step_slice(out, moment, delta, config, scratch)
    return out


@torch.no_grad()
def start_eagerly(
    model: torch.nn.Module, state: GlobalState, launch_point: torch.Tensor, config: OuterSection, staging: Staging
) -> None:
    """θ_local ← θ̂ (``eager_point``): the next inner phase starts near the state the round in
    flight will land, instead of at this peer's own end point (``averaging.overlap_start``)."""
    buffers = EagerBuffers()
    for offset, piece in model_pieces(model):
        part = slice(offset, offset + piece.numel())
        piece.copy_(eager_point(state.params[part], state.momentum[part], launch_point[part], config, buffers))


@torch.no_grad()
def undo_eager_start(
    model: torch.nn.Module, state: GlobalState, launch_point: torch.Tensor, config: OuterSection, staging: Staging
) -> None:
    """θ_local ← θ_local − θ̂ + launch point: a round that did not land takes its eager start
    back, so the model holds the launch point plus the progress since (its work folds into
    the next round's Δ, as without the eager start)."""
    buffers = EagerBuffers()
    for offset, piece in model_pieces(model):
        part = slice(offset, offset + piece.numel())
        start = eager_point(state.params[part], state.momentum[part], launch_point[part], config, buffers)
        local = staging.host(piece)
        piece.copy_(torch.sub(local, start).add_(launch_point[part]))


@torch.no_grad()
def land_round(
    model: torch.nn.Module,
    state: GlobalState,
    averaged: torch.Tensor,
    config: OuterSection,
    *,
    feedback: ErrorFeedback | None,
    launch_point: torch.Tensor | None,
    keep_progress: bool,
    staging: Staging,
    missing: Ranges = (),
    eager: bool = False,
    codec: Codec | None = None,
) -> None:
    """Apply the group's average: the codec residual of what this peer sent (when
    ``feedback``, ``update_residual``), then per slice the outer step on θ_g and the momentum
    in place and θ_local ← θ_g_new (+ θ_local − launch point when ``keep_progress``).
    ``launch_point=None``: the model has not moved since the launch (no overlap), so it is its
    own launch point. ``eager``: the inner phase since the launch started at θ̂
    (``start_eagerly``): the progress is measured from there. In the ``missing`` ranges
    (sorted ``[start, end)`` pairs the group did not average), and at the values ``codec`` (the
    round's, ``Codec.at_round``) did not send (``Codec.unsent``), θ_g, the momentum and the
    residual keep their values and θ_local its own (less the eager jump). Then the state's
    round advances."""
    missing = check_ranges(missing, state.params.numel())
    state.wait_for_digest()  # the tensors change in place from here on
    if launch_point is None and land_fused(
        model, state, averaged, config, feedback=feedback, missing=missing, codec=codec
    ):  # one compiled pass per value, the same bits
        state.round += 1
        return
    if feedback is not None:
        update_residual(model, state.params, feedback, launch_point, staging, missing, codec=codec)
    scratch = torch.empty(CHUNK_VALUES, dtype=torch.float32)
    progress_buffer = torch.empty(CHUNK_VALUES, dtype=torch.float32)
    theta, momentum = state.params, state.momentum
    rebase = keep_progress and launch_point is not None
    buffers = EagerBuffers() if eager and rebase else None
    for offset, piece in model_pieces(model):
        n = piece.numel()
        part = slice(offset, offset + n)
        present, absent = split_ranges(part.start, part.stop, missing)
        start = None
        if buffers is not None:  # θ̂ from θ_g and the momentum before the outer step moves them
            assert launch_point is not None
            start = eager_point(theta[part], momentum[part], launch_point[part], config, buffers)
        unsent = _unsent(codec, offset, n)
        for kept in present:
            width = kept.stop - kept.start
            held = None if unsent is None else unsent[kept.start - offset : kept.stop - offset]
            _sent_outer_step(theta[kept], momentum[kept], averaged[kept], config, scratch[:width], held)
        if not absent and not rebase and unsent is None:
            piece.copy_(theta[part])
            continue
        local = staging.host(piece)
        new = progress_buffer[:n]
        if rebase:
            assert launch_point is not None
            torch.sub(local, launch_point[part] if start is None else start, out=new)
            new.add_(theta[part])
        else:
            new.copy_(theta[part])
        for left in absent:  # not averaged: θ_local keeps its value (θ_g there did not move)
            window = slice(left.start - offset, left.stop - offset)
            if start is None:
                new[window] = local[window]
            else:
                assert launch_point is not None
                new[window] = local[window] - start[window] + launch_point[left]
        if unsent is not None:  # not sent: as not averaged (element-wise selects: a mask index is ~20x slower)
            if start is None:
                torch.where(unsent, local, new, out=new)
            else:
                assert launch_point is not None
                torch.where(unsent, torch.sub(local, start).add_(launch_point[part]), new, out=new)
        piece.copy_(new)
    state.round += 1


@torch.no_grad()
def roll_forward(state: GlobalState, update: FetchedUpdate, config: OuterSection, codec: Codec) -> None:
    """Take the state of ``update.round`` one round forward as every member's landing did
    (``land_round``: the outer step where the round averaged; θ_g and the momentum keep their
    values in ``update.left_out`` and at the values ``codec``, bound to the round, did not
    send), decoding the reducers' bytes part by part. ``MalformedTensorError`` if a part does
    not decode (the state is then half changed: the caller drops it). The caller checks the
    digest it makes."""
    if update.round != state.round:
        raise ValueError(f"update of round {update.round} for a state of round {state.round}")
    missing = check_ranges(update.left_out, state.params.numel())
    bound = codec.at_round(update.round)
    state.wait_for_digest()
    scratch = torch.empty(CHUNK_VALUES, dtype=torch.float32)
    theta, momentum = state.params, state.momentum
    for start, values, buffer in update.parts:
        decoded = bound.decode(buffer, values)
        for window in chunks(values):
            lo, hi = start + window.start, start + window.stop
            present, _ = split_ranges(lo, hi, missing)
            unsent = _unsent(bound, lo, hi - lo)
            for kept in present:
                width = kept.stop - kept.start
                held = None if unsent is None else unsent[kept.start - lo : kept.stop - lo]
                averaged = decoded[kept.start - start : kept.stop - start]
                _sent_outer_step(theta[kept], momentum[kept], averaged, config, scratch[:width], held)
    state.round += 1


def _unsent(codec: Codec | None, start: int, count: int) -> torch.Tensor | None:
    """``codec``'s unsent mask of ``[start, start + count)``, or None when it sent them all."""
    if codec is None:
        return None
    unsent = codec.unsent(start, count)
    # (the bytes' max: ``any`` on a bool tensor takes 25x as long on the CPU)
    if unsent is None or not unsent.numel():
        return None
    return unsent if bool(unsent.view(torch.uint8).max()) else None


def _sent_outer_step(
    theta: torch.Tensor,
    momentum: torch.Tensor,
    averaged: torch.Tensor,
    config: OuterSection,
    scratch: torch.Tensor,
    unsent: torch.Tensor | None,
) -> None:
    """The outer step on one slice, leaving θ_g and the momentum as they were at the ``unsent``
    values: on the whole slice, then the old values selected back where unsent (the step is
    element-wise, so the sent values get the bits a step on them alone would give; a mask index
    of the sent values instead costs ~20x the time of these dense passes on the CPU)."""
    if unsent is None:
        outer_step_slice(theta, momentum, averaged, config, scratch)
        return
    kernels = compiled_kernels()
    if kernels is not None and all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in (theta, momentum, averaged)
    ):  # the same bits in one pass, without the copies and selects
        kernels.outer_step_masked(
            theta.numpy(), momentum.numpy(), averaged.numpy(), unsent.contiguous().numpy(), config.lr,
            config.momentum, config.nesterov,
        )  # fmt: skip
        return
    kept = torch.stack((theta, momentum))  # copies of the old values (a chunk each)
    outer_step_slice(theta, momentum, averaged, config, scratch)
    torch.where(unsent, kept[0], theta, out=theta)
    torch.where(unsent, kept[1], momentum, out=momentum)


@torch.no_grad()
def land_global(
    state: GlobalState,
    averaged: torch.Tensor,
    config: OuterSection,
    *,
    feedback: ErrorFeedback | None,
    launch_point: torch.Tensor,
    missing: Ranges = (),
    eager: bool = False,
    codec: Codec | None = None,
) -> None:
    """``land_round``'s host half, touching no model: the codec residual (when ``feedback``),
    the outer step on θ_g and the momentum in place, and ``launch_point`` ← the shift that
    re-bases the model (``rebase_model``): θ_g_new − start point where the group averaged,
    start point being the launch point or θ̂ after an eager start; launch point − θ̂ (eager) or 0
    in the ``missing`` ranges and at the values ``codec`` did not send (``land_round``). The
    state's round does not advance (the caller advances it once the model is re-based)."""
    missing = check_ranges(missing, state.params.numel())
    state.wait_for_digest()  # the tensors change in place from here on
    if not eager and land_global_fused(
        state, averaged, config, feedback=feedback, launch_point=launch_point, missing=missing, codec=codec
    ):  # one compiled pass per value, the same bits
        return
    if feedback is not None:
        update_residual(_NO_MODEL, state.params, feedback, launch_point, Staging(_NO_MODEL), missing, codec=codec)
    scratch = torch.empty(CHUNK_VALUES, dtype=torch.float32)
    theta, momentum = state.params, state.momentum
    buffers = EagerBuffers() if eager else None
    for part in chunks(theta.numel()):
        present, absent = split_ranges(part.start, part.stop, missing)
        start = None
        if buffers is not None:  # θ̂ from θ_g and the momentum before the outer step moves them
            start = eager_point(theta[part], momentum[part], launch_point[part], config, buffers)
        unsent = _unsent(codec, part.start, part.stop - part.start)
        for kept in present:
            width = kept.stop - kept.start
            window = slice(kept.start - part.start, kept.stop - part.start)
            held = None if unsent is None else unsent[window]
            _sent_outer_step(theta[kept], momentum[kept], averaged[kept], config, scratch[:width], held)
        for kept in present:
            window = slice(kept.start - part.start, kept.stop - part.start)
            base = launch_point[kept] if start is None else start[window]
            held = None if unsent is None else unsent[window]
            own = None  # not sent: as not averaged (the shift below, before it is overwritten)
            if held is not None and start is not None:
                own = torch.sub(launch_point[kept], start[window])
            torch.sub(theta[kept], base, out=launch_point[kept])
            if held is not None and own is not None:
                torch.where(held, own, launch_point[kept], out=launch_point[kept])
            elif held is not None:
                launch_point[kept].masked_fill_(held, 0.0)
        for left in absent:  # not averaged: θ_local keeps its own value (less the eager jump)
            window = slice(left.start - part.start, left.stop - part.start)
            if start is None:
                launch_point[left].zero_()
            else:
                torch.sub(launch_point[left], start[window], out=launch_point[left])


DELTA_THREAD_VALUES = 1 << 18
"""Values per piece a thread takes in the launch's Δ (``engine.kernels.run_chunks``)."""
_NO_MODEL = torch.nn.Module()
_NO_RESIDUAL = np.empty(0, np.uint16)
"""``update_residual`` reads the launch point, never the model, when it is given one."""


@torch.no_grad()
def rebase_model(model: torch.nn.Module, shift: torch.Tensor) -> None:
    """θ_local ← θ_local + ``shift`` (flat, ``flatten`` order): in host memory one chunk at a
    time, on an accelerator one copy per parameter (a chunk per copy would pay a transfer's
    fixed cost ~10,000 times per GB)."""
    for offset, values in parameter_views(model):
        n = values.numel()
        if values.device.type == "cpu":
            for part in chunks(n):
                values[part].add_(shift[offset + part.start : offset + part.stop])
        else:
            # from pinned memory asynchronously: the shift's next writer (the next launch) is
            # queued after this add or waits for it
            values.add_(shift[offset : offset + n].to(values.device, non_blocking=shift.is_pinned()))
