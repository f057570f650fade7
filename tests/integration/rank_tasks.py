"""An import task for ``test_local_ranks``: the built-in byte-GPT, except that the peer whose
shard seed is ``pair_seed`` trains each step on the batches of *both* local ranks of a
two-rank node with that seed (what the node's two ranks together train on)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from peer.node.node import rank_shard_seed
from peer.task import Task, build_task
from peer.task.base import Batch
from protocol.spec import RunSpec


def bytegpt(*, spec: RunSpec, shard_seed: int, device: str, pair_seed: int | None = None) -> Task:
    task = spec.task.model_copy(update={"kind": "bytegpt", "factory": None, "options": {}})
    plain = spec.model_copy(update={"task": task})
    if shard_seed != pair_seed:
        return build_task(plain, shard_seed=shard_seed, device=device)
    ranks = [build_task(plain, shard_seed=rank_shard_seed(shard_seed, r), device=device) for r in (0, 1)]

    def both() -> Iterator[Batch]:
        while True:
            batches = [next(rank.batches) for rank in ranks]
            yield torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    first = ranks[0]
    return Task(first.model, both(), first.loss_fn, 2 * first.samples_per_batch, first.flops_per_sample)
