"""``build_task``: the spec's ``[task]`` section turned into a ``Task``.

- kind = "bytegpt": the built-in byte-level GPT on the spec's corpus. The model's init
  seed comes from ``data.seed`` alone, so every peer of the run starts bit-identical.
- kind = "causal_lm": a transformers causal LM on prepared token shards
  (``peer.task.causal_lm``), one data stream of the run per peer.
- kind = "import": ``factory = "package.module:function"`` is imported and called as
  ``function(spec=spec, shard_seed=..., device=..., **task.options)``; it must return a
  ``Task`` and shard its own data by ``shard_seed``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from peer.task import bytegpt, data
from peer.task.base import Batch, Task, derive_seed
from protocol.errors import ConfigError
from protocol.modelsize import task_flops_per_sample, task_params
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


def build_task(
    spec: RunSpec,
    *,
    shard_seed: int,
    device: str = "cpu",
    num_shards: int = 1,
    shard_index: int = 0,
    slot: int | None = None,
    data_dir: str | Path | None = None,
    weights_dir: str | Path | None = None,
    data_cap_bytes: int | None = None,
) -> Task:
    """The task of one peer. ``shard_seed`` picks its random windows; ``num_shards`` > 1
    also splits the training files (this peer keeps files ``shard_index::num_shards``,
    byte-level task only). A causal-LM task trains data stream ``slot`` (handed out by the
    coordinator) of the prepared data at ``data_dir`` (default: the spec's ``data.path``),
    starting from the weights at ``weights_dir`` if the spec names weights; a run that publishes
    its data fetches the shards it reads, keeping at most ``data_cap_bytes`` of them.
    Raises ConfigError for a bad corpus, data that does not match the spec, or a bad factory."""
    if spec.task.kind == "bytegpt":
        shards = {"num_shards": num_shards, "shard_index": shard_index}
        return _build_bytegpt(spec, shard_seed=shard_seed, device=device, **shards)
    if spec.task.kind == "causal_lm":
        from peer.task.causal_lm import build_causal_lm  # transformers: only for this task

        if slot is None:
            slot = shard_seed % spec.data.slots
            logger.warning(
                "no data stream from a coordinator: training stream %d of %d (from the shard seed); "
                "peers without a coordinator may train the same data",
                slot,
                spec.data.slots,
            )
        return build_causal_lm(
            spec, device=device, slot=slot, data_dir=data_dir, weights_dir=weights_dir, data_cap_bytes=data_cap_bytes
        )
    if num_shards != 1:
        raise ConfigError(f"num_shards = {num_shards}: import tasks shard their data by shard_seed only")
    return _build_import(spec, shard_seed=shard_seed, device=device)


def known_param_count(spec: RunSpec) -> int | None:
    """The task's parameter count from the spec alone, without building anything (built-in
    tasks, imported ones that declare it); None when only building the task tells."""
    return task_params(spec)


def lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T) -> (B, T, V) language model, in float32."""
    inputs, targets = batch
    device = next(model.parameters()).device
    logits = model(inputs.to(device, non_blocking=True))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device, non_blocking=True).flatten())


def _build_bytegpt(spec: RunSpec, *, shard_seed: int, device: str, num_shards: int, shard_index: int) -> Task:
    cfg = spec.task.model
    corpus = data.load_corpus(spec.data, context=cfg.context, num_shards=num_shards, shard_index=shard_index)
    model = bytegpt.build_model(cfg, seed=derive_seed(spec.data.seed, "model-init"), device=device)
    common = {"context": cfg.context, "batch_size": spec.inner.batch_size, "data_seed": spec.data.seed}
    has_val = corpus.val.numel() >= cfg.context + 1
    if not has_val:
        logger.warning("held-out data has %d bytes, less than one sequence: no validation loss", corpus.val.numel())
    return Task(
        model=model,
        batches=data.train_batches(corpus.train, shard_seed=shard_seed, **common),
        loss_fn=lm_loss,
        samples_per_batch=spec.inner.batch_size,
        flops_per_sample=bytegpt.flops_per_sample(cfg),
        eval_batches=(
            functools.partial(data.eval_batches, corpus.val, n_batches=spec.eval.batches, **common) if has_val else None
        ),
    )


def _build_import(spec: RunSpec, *, shard_seed: int, device: str) -> Task:
    path = spec.task.factory
    assert path is not None  # the spec enforces it for kind = "import"
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task.factory {path!r}: cannot import module {module_name!r} ({exc})") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"task.factory {path!r}: module {module_name!r} has no attribute {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise ConfigError(f"task.factory {path!r}: {attr!r} is a {type(factory).__name__}, not a function")
    clash = {"spec", "shard_seed", "device"} & spec.task.options.keys()
    if clash:
        raise ConfigError(f"task.options may not set {sorted(clash)}: build_task passes them to {path!r}")
    task = factory(spec=spec, shard_seed=shard_seed, device=device, **spec.task.options)
    if not isinstance(task, Task):
        raise ConfigError(f"task.factory {path!r} returned {type(task).__name__}, not a peer.task.Task")
    if spec.task.flops_per_sample is not None or spec.task.params is not None:
        task.flops_per_sample = task_flops_per_sample(spec)  # what the coordinator credits
    return task
