"""The global state every peer of a run holds identically: θ_g, outer momentum, round.

``GlobalState.digest()`` is the BLAKE3 hash over the round number and the exact bytes of both
tensors (``protocol.statesync.state_digest``); peers publish it after every round, and equal
digests mean bit-identical replicas.

The outer step (SGD with optional Nesterov momentum, on the averaged pseudo-gradient) runs in
place, a chunk at a time (no full-size temporaries), as separate, individually rounded
element-wise operations (no ``alpha=`` arguments, no fused multiply-add kernels, no
foreach/fused optimizer paths) so that every machine computing it from the same bytes gets the
same bytes. Element-wise results do not depend on the chunking nor on in-place versus
out-of-place evaluation.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.compression import compiled_kernels
from protocol.spec import OuterSection
from protocol.statesync import state_digest

CHUNK_VALUES = 1 << 17
"""Values per chunk of the host-side passes over the state (512 KiB of float32): small enough
that a pass's few operations run on cache-resident data and its temporaries come from the
allocator's free lists (no page faults), large enough to amortize the per-chunk overhead
(~1000 chunks per GB)."""


@dataclass
class GlobalState:
    """θ_g and the outer optimizer's momentum, flat float32 on CPU, plus the round number.

    The digest is computed once per state and cached: assigning ``params``, ``momentum`` or
    ``round`` forgets it, and so does ``outer_step`` (the only in-place change).
    ``start_digest`` computes it on a background thread (BLAKE3 releases the GIL), so that
    hashing overlaps the next inner steps; ``digest()`` waits for it; nothing may change the
    tensors in place before ``wait_for_digest()``."""

    params: torch.Tensor
    momentum: torch.Tensor
    round: int = 0
    digest_s: float = field(default=0.0, init=False, repr=False, compare=False)
    """Seconds the last digest computation took."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("params", "momentum", "round"):
            object.__setattr__(self, "_digest", None)
            object.__setattr__(self, "_job", None)  # a running hash of the old state is abandoned
        object.__setattr__(self, name, value)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> GlobalState:
        params = flatten(model)
        return cls(params=params, momentum=torch.zeros_like(params), round=0)

    def digest(self) -> str:
        """``blake3:<hex>`` of (round, params bytes, momentum bytes), cached for this state."""
        self.wait_for_digest()
        cached: str | None = getattr(self, "_digest", None)
        if cached is None:
            started = time.monotonic()
            cached = state_digest(self.round, self.params, self.momentum, threads=torch.get_num_threads())
            object.__setattr__(self, "digest_s", time.monotonic() - started)
            object.__setattr__(self, "_digest", cached)
        return cached

    def start_digest(self) -> None:
        """Start computing the digest on a background thread (no-op if known or under way)."""
        if getattr(self, "_digest", None) is not None or getattr(self, "_job", None) is not None:
            return
        box: dict[str, object] = {}
        round_, params, momentum = self.round, self.params, self.momentum

        def work() -> None:
            started = time.monotonic()
            box["digest"] = state_digest(round_, params, momentum, threads=torch.get_num_threads())
            box["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=work, name="state-digest", daemon=True)
        object.__setattr__(self, "_job", (thread, box))
        thread.start()

    def digest_ready(self) -> bool:
        """Whether ``digest()`` returns without hashing or waiting."""
        job = getattr(self, "_job", None)
        if job is not None:
            return not job[0].is_alive()
        return getattr(self, "_digest", None) is not None

    def wait_for_digest(self) -> None:
        """Wait for a background digest to finish and keep its result."""
        job = getattr(self, "_job", None)
        if job is None:
            return
        thread, box = job
        thread.join()
        object.__setattr__(self, "_job", None)
        if "digest" in box:
            object.__setattr__(self, "_digest", box["digest"])
            object.__setattr__(self, "digest_s", box["seconds"])

    def clone(self) -> GlobalState:
        return GlobalState(self.params.clone(), self.momentum.clone(), self.round)


def chunks(numel: int, size: int = CHUNK_VALUES) -> Iterator[slice]:
    """Consecutive slices of at most ``size`` values covering ``range(numel)``."""
    for start in range(0, numel, size):
        yield slice(start, min(start + size, numel))


@torch.no_grad()
def outer_step_slice(
    params: torch.Tensor, momentum: torch.Tensor, averaged: torch.Tensor, config: OuterSection, scratch: torch.Tensor
) -> None:
    """The outer step on one slice of the state, in place (``scratch``: a buffer of the slice's
    size). θ ← θ − lr·u, with u = Δ̄ (plain), or m ← μ·m + Δ̄ and u = m (heavy ball) or
    Δ̄ + μ·m (Nesterov); each operation rounded on its own."""
    kernels = compiled_kernels()
    if kernels is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in (params, momentum, averaged)):
        # the same operations in the same order, one pass (``engine.kernels.outer_step``)
        kernels.outer_step(
            params.numpy(), momentum.numpy(), averaged.numpy(), config.lr, config.momentum, config.nesterov
        )
        return
    lr = torch.tensor(config.lr, dtype=torch.float32)
    if config.momentum > 0:
        mu = torch.tensor(config.momentum, dtype=torch.float32)
        torch.mul(momentum, mu, out=momentum)
        momentum.add_(averaged)
        if config.nesterov:
            torch.mul(momentum, mu, out=scratch)
            scratch.add_(averaged)
            torch.mul(scratch, lr, out=scratch)
        else:
            torch.mul(momentum, lr, out=scratch)
    else:
        torch.mul(averaged, lr, out=scratch)
    params.sub_(scratch)


@torch.no_grad()
def outer_step(state: GlobalState, averaged_delta: torch.Tensor, config: OuterSection) -> None:
    """The outer step on the whole state, in place, chunk by chunk; then the next round."""
    assert averaged_delta.shape == state.params.shape and averaged_delta.dtype == torch.float32
    state.wait_for_digest()
    scratch = torch.empty(min(CHUNK_VALUES, state.params.numel()), dtype=torch.float32)
    for part in chunks(state.params.numel()):
        n = part.stop - part.start
        outer_step_slice(state.params[part], state.momentum[part], averaged_delta[part], config, scratch[:n])
    state.round += 1


def model_pieces(model: torch.nn.Module, size: int = CHUNK_VALUES) -> Iterator[tuple[int, torch.Tensor]]:
    """``(offset, values)``: the model's parameters in ``flatten`` order as flat views of at most
    ``size`` values each (writing to a view writes the parameter)."""
    offset = 0
    for p in model.parameters():
        if not p.is_contiguous():
            raise ValueError("model parameters must be contiguous")
        flat = p.detach().view(-1)
        for part in chunks(flat.numel(), size):
            yield offset + part.start, flat[part]
        offset += flat.numel()


def parameter_views(model: torch.nn.Module) -> Iterator[tuple[int, torch.Tensor]]:
    """``(offset, values)``: each parameter whole, as a flat view, in ``flatten`` order."""
    offset = 0
    for p in model.parameters():
        if not p.is_contiguous():
            raise ValueError("model parameters must be contiguous")
        yield offset, p.detach().view(-1)
        offset += p.numel()


def flatten(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one new float32 CPU vector (parameter order of ``model.parameters()``);
    one copy per parameter (from a GPU, one transfer each)."""
    numel = sum(p.numel() for p in model.parameters())
    out = torch.empty(numel, dtype=torch.float32)
    for offset, values in parameter_views(model):
        out[offset : offset + values.numel()].copy_(values)
    return out


@torch.no_grad()
def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector (as made by ``flatten``) into the model's parameters, one copy per
    parameter."""
    end = 0
    for offset, values in parameter_views(model):
        end = offset + values.numel()
        values.copy_(flat[offset:end])
    assert end == flat.numel(), "flat vector does not match the model"


Ranges = Sequence[tuple[int, int]]
"""Sorted, disjoint ``[start, end)`` ranges of the flat state."""


def split_ranges(start: int, stop: int, missing: Ranges) -> tuple[list[slice], list[slice]]:
    """``[start, stop)`` cut into the slices outside ``missing`` and those inside it (absolute
    positions, in order)."""
    present: list[slice] = []
    absent: list[slice] = []
    cursor = start
    for lo, hi in missing:
        lo, hi = max(lo, start), min(hi, stop)
        if lo >= hi:
            continue
        if cursor < lo:
            present.append(slice(cursor, lo))
        absent.append(slice(lo, hi))
        cursor = hi
    if cursor < stop:
        present.append(slice(cursor, stop))
    return present, absent


def model_window(
    views: Sequence[tuple[int, torch.Tensor]], start: int, count: int, offsets: Sequence[int] = ()
) -> Iterator[tuple[torch.Tensor, slice]]:
    """The flat model values ``[start, start + count)`` across parameters: each parameter's part
    of it (a view) with its place in the window, from the model's ``parameter_views`` (listed
    once per pass: walking the module tree for every chunk cost more than the copy);
    ``offsets``: theirs, to find the first one at once."""
    stop = start + count
    first = max(0, bisect.bisect_right(offsets or [offset for offset, _ in views], start) - 1)
    for offset, flat in views[first:]:
        if offset >= stop:
            return
        lo, hi = max(start, offset), min(stop, offset + flat.numel())
        if lo < hi:
            yield flat[lo - offset : hi - offset], slice(lo - start, hi - start)


def read_model_window(
    views: Sequence[tuple[int, torch.Tensor]], start: int, out: torch.Tensor, offsets: Sequence[int] = ()
) -> None:
    """``out`` ← the flat model values ``[start, start + len(out))`` (``model_window``)."""
    for values, place in model_window(views, start, out.numel(), offsets):
        out[place].copy_(values)


def write_model_window(
    views: Sequence[tuple[int, torch.Tensor]], start: int, values: torch.Tensor, offsets: Sequence[int] = ()
) -> None:
    """The flat model values ``[start, start + len(values))`` ← ``values``: ``read_model_window``'s reverse."""
    for target, place in model_window(views, start, values.numel(), offsets):
        target.copy_(values[place])
