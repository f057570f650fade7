"""This peer's checkpoint (``engine.checkpoint``): θ_g, the outer momentum, the model, the inner
optimizer, the codec residual and where its data stands, saved after a round lands and read
back when the peer restarts."""

from __future__ import annotations

import logging
import math

from engine.checkpoint import Checkpointer
from engine.compression import ErrorFeedback
from peer.round.local import Crew, LocalState
from peer.round.round_metrics import RoundJournal
from peer.round.state import GlobalState

logger = logging.getLogger(__name__)


def restore(
    checkpointer: Checkpointer,
    local: LocalState,
    *,
    feedback: ErrorFeedback | None,
    sharded: bool,
    journal: RoundJournal | None,
) -> None:
    """Resume ``local`` (and the codec residual in ``feedback``) from the latest checkpoint, if
    there is one (``sharded``: over local ranks, whose inner optimizer state it does not hold)."""
    record = checkpointer.latest()
    if record is None:
        return
    local.state = GlobalState(record["params"], record["momentum"], record["round"])
    local.model.load_state_dict(record["model"])
    if sharded or record.get("inner_optimizer") is None:
        # sharded: each rank holds its shard of the optimizer state, and the checkpoint none
        logger.info("the inner optimizer starts afresh (the checkpoint holds no state for it)")
    else:
        local.optimizer.load_state_dict(record["inner_optimizer"])
    if feedback is not None and record.get("residual") is not None:
        feedback.load_residual(record["residual"])
    local.inner_steps_done = int(record["inner_steps_done"])
    local.data_round = int(record.get("data_round", -1))
    landed = record.get("landed")
    local.resumed_landed = float(landed) if isinstance(landed, (int, float)) and math.isfinite(landed) else None
    logger.info("resumed from the checkpoint of round %d (%s)", local.state.round, local.state.digest()[:19])
    if journal is not None:
        journal.holds(local.state.round, local.state.digest())


def save(crew: Crew, local: LocalState) -> None:
    """Checkpoint ``local`` (nothing without a checkpoint directory)."""
    if crew.checkpointer is None:
        return
    state = local.state
    crew.checkpointer.save(
        {
            "round": state.round,
            "params": state.params,
            "momentum": state.momentum,
            "model": local.model.state_dict(),
            # sharded over local ranks, the state is spread over the ranks: not kept (a restarted
            # node's inner optimizer starts afresh, as after a dropped model)
            "inner_optimizer": None if crew.ranks.sharded else local.optimizer.state_dict(),
            "residual": crew.feedback.state if crew.feedback is not None else None,
            "inner_steps_done": local.inner_steps_done,
            "data_round": local.data_round,
            # when this peer landed this state by averaging (None: adopted): resumed, its digest
            # record says so again, or a group beside it that lost its roster could take the
            # round for unlanded (``protocol.roster.landed_beside``)
            "landed": crew.publisher.landed_at(state.round, state.digest()),
        },
        digest=state.digest(),
    )
