"""The local ranks of a node, as the training loop sees them: one object behind which a single
rank does nothing and several ranks (``peer.node.node.LocalNode``: DDP, or FSDP2 shards) are told
what the leader does.

The leader's loop calls, in this order, for every stretch of inner steps:
- ``host_work_next(model)`` before anything reads or changes the model outside an inner step
  (a launch, a landing, a re-sync): sharded, the shards are gathered into the leader's full
  copy first; either way the other ranks must take the model again before the next step;
- ``before_step(...)`` before each inner step: the other ranks take the leader's model (and,
  unsharded, its inner-optimizer state) if they must, then run the same step;
- ``mean(loss)`` after it: the step's loss over the ranks.
``optimizer_rebuilt()`` says the leader threw its inner optimizer away (the others rebuild
theirs at the next sync).
"""

from __future__ import annotations

from typing import Protocol

import torch

from peer.node.node import Command, LocalNode

__all__ = ["LocalRanks", "NodeRanks", "OneRank", "local_ranks"]


class LocalRanks(Protocol):
    world_size: int
    """Ranks training (1: this process alone)."""
    sharded: bool
    """FSDP2 shards over the ranks: the leader's model is a plain full copy of them, kept on the
    host (no device copy to evaluate on, no inner-optimizer state to checkpoint)."""
    forward: torch.nn.Module
    """What inner steps run: the model itself, behind DDP, or this rank's FSDP2 shard of it."""

    def host_work_next(self, model: torch.nn.Module) -> None: ...

    def before_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, round_: int, step: int, data_round: int
    ) -> None: ...

    def mean(self, loss: float) -> float: ...

    def optimizer_rebuilt(self) -> None: ...


class OneRank:
    """A node of one rank: inner steps run on the model itself; nothing to tell anyone."""

    world_size = 1
    sharded = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.forward = model

    def host_work_next(self, model: torch.nn.Module) -> None:
        pass

    def before_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, round_: int, step: int, data_round: int
    ) -> None:
        pass

    def mean(self, loss: float) -> float:
        return loss

    def optimizer_rebuilt(self) -> None:
        pass


class NodeRanks:
    """The leader of a node of several ranks (``peer.node.node``)."""

    def __init__(self, node: LocalNode, model: torch.nn.Module, *, shard: bool) -> None:
        self.node = node
        self.forward = node.wrap(model, shard=shard)
        self.world_size = node.world_size
        self.sharded = node.sharded
        self._generation = 0
        """Counts rebuilds of the inner optimizer; the other ranks rebuild theirs on a change."""
        self._synced = False
        """Whether the other ranks hold this model (and, unsharded, this inner-optimizer state)."""
        self._shards_ahead = False
        """Sharded: inner steps moved the shards since the model last gathered them."""

    def host_work_next(self, model: torch.nn.Module) -> None:
        if self.sharded and self._shards_ahead:
            self.node.send(Command.GATHER)
            self.node.gather(self.forward, model)
            self._shards_ahead = False
        self._synced = False

    def before_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, round_: int, step: int, data_round: int
    ) -> None:
        if not self._synced:
            self.node.send(Command.SYNC, self._generation)
            self.node.sync(model, self.forward, optimizer)
            self._synced = True
        self.node.send(Command.STEP, round_, step, data_round)
        self._shards_ahead = True

    def mean(self, loss: float) -> float:
        return self.node.mean(loss)

    def optimizer_rebuilt(self) -> None:
        self._generation += 1


def local_ranks(node: LocalNode | None, model: torch.nn.Module, *, shard: bool) -> LocalRanks:
    """The ranks of this node: ``node``'s when it runs several, else this process alone."""
    return NodeRanks(node, model, shard=shard) if node is not None else OneRank(model)
