"""The inner steps' gradients in the averager's vector: one model-sized buffer fewer.

Without overlap the averager's shared vector (``SwarmPort.outbox``) is idle while a peer
trains: it holds a round's Δ from the launch until the landing has read the average, and
nothing after that until the next launch writes it whole. The gradients live exactly then:
from a phase's first backward to the launch, which drops them (they are dead until the next
step). So a peer training on CPU without overlap keeps its parameters' ``.grad`` as views of
that vector (``flatten`` order, one float32 value per parameter value), and backward
accumulates into them in place: host memory holds one model-sized vector for both, where it
held two (docs/design/gaps.md 1, principle 5 of docs/ARCHITECTURE.md).

The vector is lent (``SwarmPort.lend_outbox``: the averager's lock, held) from a phase's first
step until the launch releases it, so no round can average it meanwhile; a phase that finds
it held (a round still averaging, which a peer without overlap does not start its next phase
under) trains with gradients of its own, as do peers with overlap (the next phase trains
while the vector averages), on an accelerator (the gradients live on the device) or on
several local ranks.
"""

from __future__ import annotations

import logging

import torch

from peer.round.state import parameter_views
from peer.round.swarm_port import LentOutbox, SwarmPort

logger = logging.getLogger(__name__)


def gradients_fit(model: torch.nn.Module, vector_numel: int) -> bool:
    """Whether ``model``'s gradients can live in a float32 CPU vector of ``vector_numel`` values."""
    params = list(model.parameters())
    return (
        bool(params)
        and all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in params)
        and sum(p.numel() for p in params) == vector_numel
    )


class GradHome:
    """Keeps a model's gradients in the lent outbox while it may (see the module's doc)."""

    def __init__(self, swarm: SwarmPort, *, enabled: bool) -> None:
        self.swarm = swarm
        self.enabled = enabled
        """False: the gradients always get memory of their own (overlap, an accelerator, ranks)."""
        self._lent: LentOutbox | None = None

    @property
    def bound(self) -> bool:
        """Whether the gradients live in the outbox now."""
        return self._lent is not None

    @torch.no_grad()
    def bind(self, model: torch.nn.Module) -> bool:
        """Before a step: the gradients in the outbox if they may be (borrowing it for the rest of
        the phase); whether they are. The step zeroes them in place (``inner_step``'s
        ``keep_grads``) rather than dropping them."""
        if self._lent is not None or not self.enabled:
            return self._lent is not None
        lent = self.swarm.lend_outbox()
        if lent is None:  # a round still averages it: this phase's gradients get their own memory
            return False
        vector = lent.vector
        if vector.dtype != torch.float32 or vector.device.type != "cpu" or not gradients_fit(model, vector.numel()):
            lent.release()
            self.enabled = False
            logger.debug(
                "the gradients keep memory of their own (the model is not a CPU float32 one of the vector's size)"
            )
            return False
        for (offset, values), param in zip(parameter_views(model), model.parameters()):
            if param.requires_grad:  # (a frozen one keeps no gradient: an optimizer would step it)
                param.grad = vector[offset : offset + values.numel()].view_as(param)
        self._lent = lent
        return True

    def release(self, model: torch.nn.Module) -> None:
        """The phase is over (a launch, a stop): the gradients dropped, the outbox given back."""
        lent, self._lent = self._lent, None
        if lent is None:
            return
        for param in model.parameters():
            param.grad = None
        lent.release()
