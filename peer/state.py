"""The global state every peer of a run holds identically: θ_g, outer momentum, round.

``GlobalState.digest()`` is the SHA-256 over the round number and the exact bytes of both
tensors; peers publish it after every round, and equal digests mean bit-identical replicas.

The outer step (SGD with optional Nesterov momentum, on the averaged pseudo-gradient) is
written as separate, individually rounded element-wise operations (no ``alpha=`` arguments,
no fused multiply-add kernels, no foreach/fused optimizer paths) so that every machine
computing it from the same bytes gets the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.spec import OuterSection
from protocol.statesync import state_digest


@dataclass
class GlobalState:
    """θ_g and the outer optimizer's momentum, flat float32 on CPU, plus the round number.

    The digest is computed once per state and cached: assigning ``params``, ``momentum`` or
    ``round`` forgets it. The tensors are never modified in place (``outer_step`` assigns new
    ones), which is what makes the cache safe."""

    params: torch.Tensor
    momentum: torch.Tensor
    round: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("params", "momentum", "round"):
            object.__setattr__(self, "_digest", None)
        object.__setattr__(self, name, value)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> GlobalState:
        params = flatten(model).clone()
        return cls(params=params, momentum=torch.zeros_like(params), round=0)

    def digest(self) -> str:
        """``sha256:<hex>`` of (round, params bytes, momentum bytes), cached for this state."""
        cached: str | None = getattr(self, "_digest", None)
        if cached is None:
            cached = state_digest(self.round, self.params, self.momentum)
            object.__setattr__(self, "_digest", cached)
        return cached

    def clone(self) -> GlobalState:
        return GlobalState(self.params.clone(), self.momentum.clone(), self.round)


@torch.no_grad()
def outer_step(state: GlobalState, averaged_delta: torch.Tensor, config: OuterSection) -> None:
    """θ_g ← θ_g − lr·u, with u = Δ̄ (plain), or m ← μ·m + Δ̄ and u = m (heavy ball) or Δ̄ + μ·m (Nesterov)."""
    assert averaged_delta.shape == state.params.shape and averaged_delta.dtype == torch.float32
    lr = torch.tensor(config.lr, dtype=torch.float32)
    mu = torch.tensor(config.momentum, dtype=torch.float32)
    if config.momentum > 0:
        state.momentum = torch.add(torch.mul(state.momentum, mu), averaged_delta)
        update = torch.add(averaged_delta, torch.mul(state.momentum, mu)) if config.nesterov else state.momentum
    else:
        update = averaged_delta
    state.params = torch.sub(state.params, torch.mul(update, lr))
    state.round += 1


def flatten(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float32 CPU vector (parameter order of ``model.parameters()``)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])


@torch.no_grad()
def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector (as made by ``flatten``) into the model's parameters."""
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    assert offset == flat.numel(), "flat vector does not match the model"
