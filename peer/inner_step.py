"""One inner (local) training step, the same on a node's leader and on its other ranks.

With several local ranks the model passed in is wrapped in ``DistributedDataParallel``
(``peer.node``): its backward averages the gradients across the node's ranks, so every rank
clips and steps on the same gradient and the ranks' models stay equal.
"""

from __future__ import annotations

import contextlib

import torch

from peer.task import Task
from protocol.spec import RunSpec


def inner_optimizer(spec: RunSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The spec's inner optimizer over ``model``'s parameters."""
    inner = spec.inner
    if inner.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
    return torch.optim.AdamW(
        model.parameters(), lr=inner.lr, betas=(inner.betas[0], inner.betas[1]), weight_decay=inner.weight_decay
    )


def set_lr(optimizer: torch.optim.Optimizer, spec: RunSpec, step: int) -> None:
    """The inner learning rate of step ``step`` (linear warmup, then constant)."""
    warmup = spec.inner.warmup_steps
    scale = min(1.0, (step + 1) / warmup) if warmup else 1.0
    for group in optimizer.param_groups:
        group["lr"] = spec.inner.lr * scale


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    spec: RunSpec,
    *,
    step: int,
    device: str,
) -> float:
    """Train ``model`` on the task's next batch; the batch's mean loss (this rank's)."""
    inputs, targets = (t.to(device) for t in next(task.batches))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    with autocast:
        loss = task.loss_fn(model, (inputs, targets))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if spec.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
    set_lr(optimizer, spec, step)
    optimizer.step()
    return float(loss.detach())
