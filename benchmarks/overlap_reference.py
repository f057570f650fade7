"""Where overlap's loss comes from: start points and landings the product does not ship, as
references for the training-quality benchmark's ``overlap-start`` suite (issue #53).

With overlap, round r's all-reduce runs while round r+1's first inner steps compute; those steps
take their gradients somewhere other than where the round lands. The product starts them at this
peer's own end point (``averaging.overlap_start = "local"``) or at θ̂, the outer step this peer's
own Δ would take (``"eager"``). The references here start them elsewhere, or land differently,
so that the benchmark can show which point the steps' gradients should have been taken at and
what the delay costs:

- ``"global"``: at θ_g, the group's state before the round in flight (the same point in every
  member, as without overlap; one outer step behind where the round lands);
- ``"momentum"``: at θ_g moved by the outer step a Δ of ``(1 − μ)·m`` would take (the outer
  momentum's running mean standing in for the group's Δ: again the same point in every member);
- ``"half"``: at the outer step of half this peer's own Δ and half the momentum's estimate;
- ``mix``: Streaming DiLoCo's landing (arXiv 2501.18512): once the round lands the model becomes
  ``α·θ_local + (1 − α)·θ_g_new`` instead of θ_local re-based onto θ_g_new.

Each is applied for one in-process run (``benchmarks.quality_runs.run_inprocess``) by swapping
the function the product calls (``host_passes.eager_point``, ``landing.land_round``) for the
run's duration; the trainers run on the training thread (``TrainerOptions.host_thread =
False``), where both are called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from peer.round import host_passes, landing
from peer.round.host_passes import EagerBuffers
from peer.round.state import flatten, load_flat, outer_step_slice
from protocol.spec import OuterSection

STARTS = ("global", "momentum", "half")
"""Start points (with ``overlap_start = "eager"``: the product's landing measures the progress
from whatever ``eager_point`` returns, at the launch and again at the landing)."""


def reference_start(kind: str) -> Any:
    """An ``eager_point`` replacement: the start point ``kind`` (``STARTS``) of one slice, a pure
    function of θ_g, the momentum and the launch point, as the product's is."""
    if kind not in STARTS:
        raise ValueError(f"unknown reference start {kind!r}; one of {', '.join(STARTS)}")

    def start(
        theta: torch.Tensor, momentum: torch.Tensor, launch: torch.Tensor, config: OuterSection, buffers: EagerBuffers
    ) -> torch.Tensor:
        n = theta.numel()
        out, moment, delta, scratch = (row[:n] for row in buffers.values)
        out.copy_(theta)
        if kind == "global":
            return out
        torch.mul(momentum, 1.0 - config.momentum, out=delta)  # the momentum's running mean of Δ̄
        if kind == "half":
            delta.mul_(0.5).add_(torch.sub(theta, launch), alpha=0.5)
        moment.copy_(momentum)
        outer_step_slice(out, moment, delta, config, scratch)
        return out

    return start


def mixed_landing(alpha: float) -> Any:
    """A ``land_round`` replacement: the product's landing, then, where the model was re-based
    (overlap), θ_local ← α·θ_local + (1 − α)·θ_g_new with θ_local as it was before the landing."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"mix α must be in [0, 1), got {alpha}")
    product = landing.land_round

    def land(model: torch.nn.Module, state: Any, averaged: torch.Tensor, config: OuterSection, **kw: Any) -> None:
        if kw.get("launch_point") is None or not kw.get("keep_progress"):
            product(model, state, averaged, config, **kw)
            return
        before = flatten(model).clone()
        product(model, state, averaged, config, **kw)
        load_flat(model, torch.add(before.mul_(alpha), state.params, alpha=1.0 - alpha))

    return land


@contextmanager
def overlap_reference(start: str | None = None, mix: float | None = None) -> Iterator[None]:
    """The reference start point and/or landing for the runs inside (both None: the product's)."""
    saved = host_passes.eager_point, landing.land_round
    try:
        if start is not None:
            host_passes.eager_point = reference_start(start)
        if mix is not None:
            landing.land_round = mixed_landing(mix)
        yield
    finally:
        host_passes.eager_point, landing.land_round = saved
