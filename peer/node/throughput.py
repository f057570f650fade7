"""How fast this machine runs a spec's inner steps: the model as a peer builds it (portable
init, fp32 masters, the spec's precision, micro-batches and checkpointing), the peer's own
``inner_step``, on random tokens (the data path is not what is measured). Used by
``swarmtrain doctor`` (expected contribution) and ``benchmarks/lm_throughput.py``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from peer.node.inner_step import Precision, inner_optimizer, inner_step
from peer.task.base import Batch, Task, derive_seed
from protocol.modelsize import VOCAB_SIZE, task_flops_per_sample
from protocol.spec import RunSpec


@dataclass(frozen=True)
class Throughput:
    steps: int
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    flops_per_s: float
    precision: str
    losses: list[float]
    init_s: float


def _shape(spec: RunSpec) -> tuple[int, int]:
    """(vocabulary, sequence length) of the spec's task."""
    lm = spec.task.causal_lm
    if lm is not None:
        vocab = lm.config.get("vocab_size", VOCAB_SIZE)
        return (vocab if isinstance(vocab, int) else VOCAB_SIZE), lm.seq_len
    return VOCAB_SIZE, spec.task.model.context


def random_batches(spec: RunSpec) -> Iterator[Batch]:
    vocab, seq_len = _shape(spec)
    gen = torch.Generator().manual_seed(0)
    while True:
        rows = torch.randint(0, vocab, (spec.inner.batch_size, seq_len + 1), generator=gen)
        yield rows[:, :-1], rows[:, 1:]


def build_model(spec: RunSpec) -> torch.nn.Module:
    """The spec's model, initialised as every peer initialises it (no weights loaded)."""
    seed = derive_seed(spec.data.seed, "model-init")
    lm = spec.task.causal_lm
    if lm is not None:
        from peer.task.causal_lm import build_lm_model

        return build_lm_model(lm, seed=seed)
    if spec.task.kind != "bytegpt":
        raise ValueError(f"no throughput measure for task kind {spec.task.kind!r}")
    from peer.task.bytegpt import build_model as build_bytegpt

    return build_bytegpt(spec.task.model, seed=seed)


def measure(spec: RunSpec, *, device: str, steps: int, warmup: int = 1, budget_s: float | None = None) -> Throughput:
    """Time ``steps`` inner steps after ``warmup`` untimed ones on ``device``; with ``budget_s``,
    stop early once that many seconds of timed steps have run (at least one)."""
    from peer.task.causal_lm import causal_lm_loss
    from peer.task.registry import lm_loss

    started = time.perf_counter()
    model = build_model(spec).to(device)
    init_s = time.perf_counter() - started
    lm = spec.task.causal_lm
    task = Task(
        model=model,
        batches=random_batches(spec),
        loss_fn=causal_lm_loss if lm is not None else lm_loss,
        samples_per_batch=spec.inner.batch_size,
        flops_per_sample=task_flops_per_sample(spec),
        micro_batches=lm.micro_batches if lm is not None else 1,
    )
    optimizer = inner_optimizer(spec, model)
    precision = Precision.for_device(device)
    cuda = device.startswith("cuda")
    losses: list[float] = []
    timed, done = 0.0, 0
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            timed = time.perf_counter()
        losses.append(inner_step(model, optimizer, task, spec, round_=0, step=step, precision=precision))
        if step >= warmup:
            done += 1
            if budget_s is not None and time.perf_counter() - timed >= budget_s:
                break
    if cuda:
        torch.cuda.synchronize(device)
    seconds = max(time.perf_counter() - timed, 1e-9)
    samples = done * spec.inner.batch_size
    _, seq_len = _shape(spec)
    return Throughput(
        steps=done,
        seconds=seconds,
        samples_per_s=samples / seconds,
        tokens_per_s=samples * seq_len / seconds,
        flops_per_s=task.flops_per_sample * samples / seconds,
        precision=precision.name,
        losses=losses,
        init_s=init_s,
    )
