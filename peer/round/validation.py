"""The loss of θ_g, the swarm's model after a round landed, on the run's held-out batches
(``eval.every_rounds``): the peer's metrics row carries it."""

from __future__ import annotations

import logging
import time

import torch

from peer.round.local import Crew, LocalState
from peer.round.state import flatten, load_flat

logger = logging.getLogger(__name__)


def validates(crew: Crew, round_: int) -> bool:
    """Whether the state of ``round_`` gets a validation loss (``eval.every_rounds``)."""
    every = crew.spec.eval.every_rounds
    return bool(every) and crew.task.eval_batches is not None and round_ % every == 0


@torch.no_grad()
def validation_loss(crew: Crew, local: LocalState) -> float | None:
    """The loss of θ_g on the run's held-out batches, on rounds that are a multiple of
    ``eval.every_rounds``. The model holds θ_g plus this peer's progress since the launch
    (overlap): it is swapped for θ_g and back."""
    state, model = local.state, local.model
    if not validates(crew, state.round):
        return None
    assert crew.task.eval_batches is not None
    if crew.ranks.sharded:
        logger.info("no validation loss on a node sharded over its ranks (the leader holds no device copy)")
        return None
    started = time.monotonic()
    mirror = local.mirror
    if mirror is not None and not mirror.holds_theta(state.params, state.round):
        mirror = None
    held: torch.Tensor | None = None
    if mirror is not None:  # θ_g is on the device already: swap it in there
        mirror.swap_in_theta(model)
    else:
        held = flatten(model)
        load_flat(model, state.params)
    model.eval()
    total, count = 0.0, 0
    try:
        for inputs, targets in crew.task.eval_batches():
            with crew.precision.autocast():
                loss = crew.task.loss_fn(model, (inputs, targets))
            total += float(loss) * inputs.shape[0]
            count += inputs.shape[0]
    finally:
        model.train()
        if mirror is not None:
            mirror.swap_back(model)
            mirror.forget_theta()
        else:
            assert held is not None
            load_flat(model, held)
    if count == 0:
        return None
    value = total / count
    logger.info(
        "validation loss after round %d: %.4f (%d sequences, %.2f s)",
        state.round,
        value,
        count,
        time.monotonic() - started,
    )
    return value
