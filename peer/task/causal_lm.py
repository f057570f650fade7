"""The built-in causal-LM task: any language model transformers builds from a config
(Llama, Qwen2, Mistral, GPT-2), trained on prepared token shards.

- The model is built on CPU from ``[task.causal_lm]`` and initialised with
  ``peer.task.portable_init`` (seeded by the run's data seed), so every peer starts from the
  same bytes whatever its CPU or GPU; parameters are fp32 masters (autocast does the rest,
  ``peer.node.inner_step``).
- Its parameter count must equal ``protocol.modelsize``'s formula, which the coordinator
  uses for credits and the archive: a transformers version that builds another model is
  refused rather than mis-credited.
- Data: this peer's data stream's pages (``peer.task.tokens``); validation on the first
  ``eval.batches`` batches of the held-out split.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from peer.task.base import Batch, Task, derive_seed
from peer.task.lm_head import LossHead, install_loss_head
from peer.task.portable_init import portable_init_
from peer.task.tokens import AssignedBatches, TokenShards, eval_batches, open_data, run_assignment
from protocol.errors import ConfigError
from protocol.lm_shape import lm_shape
from protocol.manifest import weights_sha256
from protocol.modelsize import task_flops_per_sample
from protocol.spec import CausalLMSection, RunSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

_TIED_DEFAULT = {"gpt2": True}
"""Whether each architecture ties its output head when the config does not say (the
formula's assumption, passed to transformers explicitly so its defaults cannot drift)."""
_SCALED_PROJECTIONS = {"gpt2": ("c_proj",)}


def lm_config(lm: CausalLMSection, *, use_cache: bool = False) -> Any:
    """The spec's transformers config (ties the head as the size formula assumes)."""
    from transformers import AutoConfig

    kwargs = dict(lm.config)
    kwargs.setdefault("tie_word_embeddings", _TIED_DEFAULT.get(lm.architecture, False))
    kwargs["use_cache"] = use_cache
    try:
        return AutoConfig.for_model(lm.architecture, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"task.causal_lm.config: transformers refuses it ({exc})") from exc


def plain_lm_model(lm: CausalLMSection, *, use_cache: bool = False) -> PreTrainedModel:
    """The spec's transformers model in fp32 on CPU with its parameters left as allocated (the
    caller writes every one), its head tied as the spec says: the module ``build_lm_model``
    trains, before the loss head, and what an export saves. Its ``parameters()`` order is the
    flat state's."""
    from transformers import AutoModelForCausalLM

    config = lm_config(lm, use_cache=use_cache)
    with torch.random.fork_rng(devices=[]), _skip_transformers_init():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=lm.attention).float()
    model.tie_weights()  # post_init's own tying was skipped with transformers' init
    return model


def build_lm_model(lm: CausalLMSection, *, seed: int, weights_dir: str | Path | None = None) -> torch.nn.Module:
    """The spec's model, on CPU, initialised from ``seed`` alone (the global RNG untouched), or
    loaded from the spec's weights (continued pretraining; ``weights_dir`` overrides where this
    machine keeps them)."""
    model = plain_lm_model(lm)
    config = model.config
    if lm.weights is not None:
        _load_weights(model, lm, weights_dir)
    else:
        std = float(getattr(config, "initializer_range", 0.02))
        layers = lm_shape(lm.architecture, lm.config).layers
        portable_init_(model, std=std, seed=seed, scaled=_SCALED_PROJECTIONS.get(lm.architecture, ()), layers=layers)
    built = sum(p.numel() for p in model.parameters())
    expected = lm_shape(lm.architecture, lm.config).params
    if built != expected:
        raise ConfigError(
            f"transformers built a {lm.architecture} of {built:,} parameters; the run's formula says {expected:,} "
            "(protocol.modelsize): this transformers version builds another model"
        )
    install_loss_head(model, compiled=lm.compile)
    if lm.compile:
        _compile_blocks(model)
    if lm.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _compile_blocks(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder block in place (lazily: at its first call), the blocks
    being what every ``ModuleList`` of the model holds; the embedding and the loss head stay
    eager. One graph serves every block of a shape (dynamo caches it by code, not instance)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                block.compile()


@contextlib.contextmanager
def _skip_transformers_init() -> Iterator[None]:
    """Build without transformers' random init: every parameter is then written by
    ``portable_init_`` or loaded from the weights, so drawing them first is wasted (on CPU, half
    of a 1B model's build time: 25 s of 42 measured). Buffers (rotary frequencies) are
    computed in the modules' constructors either way; ``tests/unit/test_causal_lm.py`` checks
    that the model equals one built with transformers' init, then overwritten."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        yield


def _load_weights(model: torch.nn.Module, lm: CausalLMSection, weights_dir: str | Path | None) -> None:
    """Every parameter from the spec's safetensors weights, checked against their digest (the
    same bytes on every peer), converted to the fp32 masters. An output head tied to the
    embedding may be absent from the files; anything else missing or extra is refused."""
    from safetensors.torch import load_file

    directory = Path(weights_dir if weights_dir is not None else str(lm.weights_path))
    digest = weights_sha256(directory)
    if digest != lm.weights:
        raise ConfigError(f"weights mismatch: the weights in {directory} are {digest}, the run uses {lm.weights}")
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    try:
        with torch.no_grad():
            missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ
        first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
        raise ConfigError(f"the weights in {directory} do not fit the spec's {lm.architecture}: {first}") from exc
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()
    }
    missing = [name for name in missing if name not in tied]
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        given = [state[name] for name in names if name in state]
        if any(not torch.equal(given[0], other) for other in given[1:]):
            raise ConfigError(
                f"the weights in {directory} hold different {' and '.join(names)}, but the spec ties them "
                "(set config.tie_word_embeddings = false to train them apart)"
            )
    if missing or unexpected:
        raise ConfigError(
            f"the weights in {directory} do not fit the spec's {lm.architecture}: "
            f"missing {missing[:3]}, unexpected {list(unexpected)[:3]}"
        )
    logger.info("model weights loaded from %s (%s)", directory, digest[:19])


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy of a transformers causal LM, in float32: by the model's
    ``LossHead`` (chunked, no whole-batch logits) where it has one (every model
    ``build_lm_model`` builds), else from its logits."""
    inputs, targets = batch
    device = next(model.parameters()).device
    inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    head = next((module for module in model.modules() if isinstance(module, LossHead)), None)
    if head is None:
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    with head.scoring(targets):
        loss: torch.Tensor = model(input_ids=inputs).logits
    return loss


def build_causal_lm(
    spec: RunSpec,
    *,
    device: str,
    slot: int,
    data_dir: str | Path | None,
    weights_dir: str | Path | None = None,
    data_cap_bytes: int | None = None,
) -> Task:
    """This peer's causal-LM task: the model, data stream ``slot``'s batches, validation. A run
    that publishes its data (``data.url``) fetches the shards as its pages need them, keeping at
    most ``data_cap_bytes`` of them."""
    lm = spec.task.causal_lm
    assert lm is not None and spec.rounds.inner_steps is not None  # the spec enforces both
    directory, manifest, fetcher = open_data(spec, data_dir, cap_bytes=data_cap_bytes)
    train = TokenShards(directory, manifest, manifest.train, fetcher=fetcher)
    assignment = run_assignment(spec, manifest)
    if not assignment.round_fits_epoch():
        raise ConfigError(
            f"one round of the run reads {spec.data.slots} streams x {assignment.page} sequences, more than the "
            f"{train.sequences} prepared: fewer data.slots, rounds.inner_steps or inner.batch_size, or more data"
        )
    batches = AssignedBatches(train, assignment, slot)
    model = build_lm_model(lm, seed=derive_seed(spec.data.seed, "model-init"), weights_dir=weights_dir).to(device)
    evaluate = None
    if spec.eval.every_rounds and manifest.validation:
        val = TokenShards(directory, manifest, manifest.validation, fetcher=fetcher)
        # in micro-batches, like training: no more activation memory than a training step
        micro = spec.inner.batch_size // lm.micro_batches
        evaluate = functools.partial(
            eval_batches, val, batch_size=micro, n_batches=spec.eval.batches * lm.micro_batches
        )
    elif spec.eval.every_rounds:
        logger.warning("the prepared data has no validation split: no validation loss")
    logger.info(
        "data: %d training sequences of %d tokens in %s, stream %d of %d (epoch %.3f per round of the run)",
        train.sequences,
        manifest.seq_len,
        directory,
        slot,
        spec.data.slots,
        assignment.epoch(1),
    )
    return Task(
        model=model,
        batches=iter(()),
        loss_fn=causal_lm_loss,
        samples_per_batch=spec.inner.batch_size,
        flops_per_sample=task_flops_per_sample(spec),
        eval_batches=evaluate,
        batch_at=batches.batch_at,
        data_report=batches.report,
        micro_batches=lm.micro_batches,
    )
