"""The ``Task`` contract shared by the built-in byte-level GPT and user (import) tasks."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from peer.task.data_assignment import DataRead

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets), CPU tensors; ``loss_fn`` moves them to the model's device."""


@dataclass
class Task:
    """A model + data + loss, chosen by the spec."""

    model: torch.nn.Module
    """The replica to train, already on the requested device, initialised identically on
    every peer of the run (same parameters, bit for bit)."""
    batches: Iterator[Batch]
    """Infinite iterator of (inputs, targets) for this peer's shard, CPU tensors."""
    loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor]
    """Scalar mean loss of a batch; moves the batch to the model's device itself."""
    samples_per_batch: int
    """Samples (sequences) in each batch of ``batches``; the weight of a peer's work."""
    flops_per_sample: float
    """Training FLOPs (forward + backward) per sample, for credits and utilisation."""
    eval_batches: Callable[[], Iterator[Batch]] | None = None
    """Fresh iterator over the same fixed held-out batches at each call; None if no
    validation data."""
    batch_at: Callable[[int, int], Batch] | None = None
    """Positional data (token runs): the batch of inner step ``step`` of round ``round``, as
    assigned to this peer's data stream (``peer.task.data_assignment``); None: ``batches``."""
    data_report: Callable[[int], DataRead | None] | None = None
    """What a round read (stream, steps, digest of the sequence ids), for its report."""
    micro_batches: int = 1
    """Gradient accumulation: each batch runs in this many micro-batches."""

    def next_batch(self, round_: int, step: int) -> Batch:
        """The batch of step ``step`` of round ``round_`` (positional data), else the next one."""
        if self.batch_at is not None:
            return self.batch_at(round_, step)
        return next(self.batches)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (via SHA-256): the same on every machine and Python,
    unlike ``hash()``, and unrelated for different parts (unlike ``seed + i``)."""
    text = "swarmtrain/seed/" + "/".join(repr(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") & (2**63 - 1)


def generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``, independent of the global RNG."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen
