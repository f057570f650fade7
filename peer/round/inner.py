"""A round's inner phase: up to H optimizer steps (or the time budget) on this peer's shard,
from the round's start point (``InnerSteps.open``), or cut to end as the swarm's members end
theirs when this peer just adopted their state (a join)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from engine.fragments import fragment_bounds
from peer.node.inner_step import inner_optimizer, inner_step
from peer.round import joining as joins
from peer.round.grad_home import GradHome
from peer.round.joining import Joining
from peer.round.local import Crew, LocalState
from peer.round.progress import InnerProgress
from peer.round.state import load_flat

logger = logging.getLogger(__name__)


@dataclass
class InnerPhase:
    """The inner steps of one round so far."""

    started: float
    deadline: float
    steps: int
    round: int
    """The round these steps train for (their learning rate): the state's round, or the next
    one while the previous round still averages (overlap)."""
    data_round: int
    """The round of the data assignment these steps read (token runs): ``round``, but never
    one this peer already read (after a failed round the same ``round`` trains again, on the
    next pages: a failed round's work is folded into the next, so re-reading would count a
    page twice)."""
    done: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    joining: bool = False
    """A phase cut to end as the swarm's members end theirs (``Joining.launches_at``): its round
    is launched as a join (``Joining.join_timeout``)."""
    least: int = 0
    """Steps taken whatever the deadline (a joining phase's one)."""

    def over(self, stop: threading.Event) -> bool:
        if stop.is_set() or self.done >= self.steps:
            return True
        return self.done >= self.least and time.monotonic() >= self.deadline

    def share_done(self) -> float:
        """How much of the phase is done, 0 to 1: its steps' share, or its time budget's."""
        shares = [self.done / self.steps] if self.steps < 1 << 60 else []
        if math.isfinite(self.deadline) and self.deadline > self.started:
            shares.append((time.monotonic() - self.started) / (self.deadline - self.started))
        return min(1.0, max(shares, default=1.0))

    @property
    def loss(self) -> float:
        """Mean loss of the phase's steps; NaN when it took none (a joiner's empty phase), never
        a loss of 0 that no step measured."""
        return self.loss_sum / self.done if self.done else math.nan


class InnerSteps:
    """Opens inner phases and takes their steps; owns the inner optimizer, ``inner_steps_done``
    and ``data_round``, and drops local work that cannot be sent."""

    def __init__(self, crew: Crew, local: LocalState, joining: Joining) -> None:
        self.crew, self.local, self.joining = crew, local, joining
        on_cpu = all(p.device.type == "cpu" for p in local.model.parameters())
        # (averaged in turn, the averager's vector is one fragment long)
        in_turn = len(fragment_bounds(local.state.params.numel(), crew.spec.averaging.fragments_in_turn)) > 1
        self.grads = GradHome(
            crew.swarm, enabled=not crew.overlap and not in_turn and crew.ranks.world_size == 1 and on_cpu
        )
        """Where the gradients live: the averager's idle vector when they may (``peer.round.grad_home``)."""

    def release_gradients(self) -> None:
        """The phase is over: its gradients dropped (they are dead until the next step), the
        averager's vector given back if they lived there. Before a launch writes it."""
        self.grads.release(self.local.model)
        self.local.optimizer.zero_grad(set_to_none=True)

    def open(self, *, ahead: bool) -> InnerPhase:
        """The next inner phase: of the state's round, or of the next one while a round
        averages (``ahead``, overlap). A peer that just adopted a state joins the swarm's next
        round: with nothing (no data read) when the members' phase is unknown or over, else
        with the steps it fits before they launch."""
        crew, local = self.crew, self.local
        rounds = crew.spec.rounds
        started = time.monotonic()
        deadline = started + rounds.time_budget_s if rounds.time_budget_s else math.inf
        local.model.train()
        round_ = local.state.round + (1 if ahead else 0)
        if not ahead and (local.launch_now or crew.swarm.behind(local.state.round)):
            if local.launch_now and self.joining.too_late() and not crew.roster.known:
                self.joining.next_round()
            launch = self.joining.launches_at(local.state.round) if local.launch_now else None
            local.launch_now = False
            if launch is None or launch <= started:
                # join the swarm's next round now, with nothing to contribute (no data round read)
                return InnerPhase(started, started, 0, round_, local.data_round)
            # train until the members end their phase of this round, and join it with that work:
            # at least one step, so that the round it joins counts its work (a step is a small
            # share of a round; its declaration is that much later)
            local.carry_over = None  # the work carried over is in the model: this phase's Δ holds it
            local.data_round = max(round_, local.data_round + 1)
            # declared before the members launch: its declaration takes about a lookup to be seen
            until = max(started, launch - joins.JOIN_LEAD_S - 2 * crew.swarm.lookup_s())
            steps = rounds.inner_steps or 1 << 62
            return InnerPhase(started, until, steps, round_, local.data_round, joining=True, least=1)
        local.data_round = max(round_, local.data_round + 1)
        return InnerPhase(started, deadline, rounds.inner_steps or 1 << 62, round_, local.data_round)

    def step(self, inner: InnerPhase) -> None:
        """One inner step of ``inner``; its progress goes to the progress sink."""
        crew = self.crew
        inner.loss_sum += self._inner_step(inner)
        inner.samples += crew.task.samples_per_batch * crew.ranks.world_size
        inner.done += 1
        crew.publisher.republish_if_due()
        rounds = crew.spec.rounds
        crew.progress.inner_step(
            InnerProgress(
                self.local.state.round,
                inner.done,
                rounds.inner_steps,
                time.monotonic() - inner.started,
                rounds.time_budget_s,
                inner.samples,
                inner.loss,
            )
        )

    def _inner_step(self, inner: InnerPhase) -> float:
        crew, local = self.crew, self.local
        round_, step, data_round = inner.round, inner.done, inner.data_round
        crew.ranks.before_step(local.model, local.optimizer, round_=round_, step=step, data_round=data_round)
        keep = self.grads.bind(local.model)
        loss = inner_step(
            crew.ranks.forward,
            local.optimizer,
            crew.task,
            crew.spec,
            round_=round_,
            step=step,
            data_round=data_round,
            precision=crew.precision,
            keep_grads=keep,
        )
        local.inner_steps_done += 1
        return crew.ranks.mean(loss)

    @torch.no_grad()
    def drop_local_work(self, why: str) -> None:
        """Throw away this peer's local progress: the model goes back to θ_g (the start point)
        and the inner optimizer starts afresh (its moments may hold the same non-finite values)."""
        logger.warning(
            "dropping this peer's local work (%s): reloaded the global parameters, reset the inner "
            "optimizer; it claims no samples for this round",
            why,
        )
        crew, local = self.crew, self.local
        load_flat(local.model, local.state.params)
        local.optimizer = inner_optimizer(crew.spec, crew.ranks.forward)
        crew.ranks.optimizer_rebuilt()
        local.unlanded = (0, 0.0)
