"""A run's trained state as a Hugging Face model directory: safetensors weights, ``config.json``,
``generation_config.json`` and the tokenizer, loadable with
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

- ``causal_lm``: the spec's own transformers model with the state's parameters (the flat
  state's order is ``parameters()``'s), and the run's tokenizer, checked against the spec's
  digest.
- ``bytegpt``: the demo's byte-level GPT is a GPT-2 in all but names (learned positions,
  pre-LayerNorm blocks, exact GELU, an untied head), so it is written as a ``gpt2`` model of
  vocabulary 256 (its linear weights transposed into GPT-2's ``Conv1D`` layout) with a byte
  tokenizer whose ids are the bytes themselves.

What was exported is written beside the model as ``swarmtrain.json`` (run, round, state
digest), so a model found on disk says where it came from.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from peer.round.state import load_flat
from peer.task.bytegpt import ByteGPT
from protocol.errors import ConfigError
from protocol.manifest import TOKENIZER_FILES, tokenizer_sha256
from protocol.modelsize import VOCAB_SIZE
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)

PROVENANCE = "swarmtrain.json"


@dataclass(frozen=True)
class Exported:
    """What an export wrote, as ``swarmtrain.json`` holds it."""

    run: str
    spec_digest: str
    round: int
    state_digest: str
    architecture: str
    parameters: int


def export_model(
    spec: RunSpec,
    params: torch.Tensor,
    out_dir: Path,
    *,
    round_: int,
    state_digest: str,
    tokenizer_dir: Path | None = None,
) -> Exported:
    """Write the model whose flat parameters are ``params`` into ``out_dir`` (new or empty):
    written into a temporary sibling first and renamed, so ``out_dir`` is either whole or
    absent. ``tokenizer_dir``: where the run's ``tokenizer.json`` is (causal_lm; default: the
    spec's data path). ConfigError for a task that cannot be exported or a wrong tokenizer."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir}: not an empty directory (export writes a new one)")
    with tempfile.TemporaryDirectory(prefix="swarmtrain-tokenizer-") as fetched:
        return _export(spec, params, out_dir, round_, state_digest, tokenizer_dir, Path(fetched))


def _export(
    spec: RunSpec,
    params: torch.Tensor,
    out_dir: Path,
    round_: int,
    state_digest: str,
    tokenizer_dir: Path | None,
    scratch: Path,
) -> Exported:
    tokenizer_files: Path | None = None
    if spec.task.kind == "causal_lm":
        tokenizer_files = _tokenizer_dir(spec, tokenizer_dir, scratch)
        model, tokenizer = _causal_lm(spec, tokenizer_files), None
    elif spec.task.kind == "bytegpt":
        model, tokenizer = _bytegpt_as_gpt2(spec), byte_tokenizer()
    else:
        raise ConfigError(
            f"task kind {spec.task.kind!r}: its model is your own code, so export cannot build it; load the "
            "checkpoint's 'params' (one flat fp32 vector in your model's parameters() order) with torch.load"
        )
    expected = sum(p.numel() for p in model.parameters())
    if params.numel() != expected:
        raise ConfigError(
            f"the state holds {params.numel():,} values, the spec's model {expected:,}: another run's state"
        )
    if spec.task.kind == "bytegpt":
        _load_bytegpt_state(model, spec, params)
    else:
        load_flat(model, params)
    record = Exported(
        run=spec.run.name,
        spec_digest=spec.digest(),
        round=round_,
        state_digest=state_digest,
        architecture=str(model.config.model_type),
        parameters=expected,
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        elif tokenizer_files is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_files / name).is_file():
                    shutil.copyfile(tokenizer_files / name, staging / name)
        (staging / PROVENANCE).write_text(json.dumps(asdict(record), indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported round %d of %s to %s", round_, spec.run.name, out_dir)
    return record


def _causal_lm(spec: RunSpec, tokenizer_dir: Path) -> Any:
    from peer.task.causal_lm import plain_lm_model  # transformers: only for this task

    lm = spec.task.causal_lm
    assert lm is not None  # the spec enforces it for this kind
    model = plain_lm_model(lm, use_cache=True)
    tokenizer = _load_tokenizer(tokenizer_dir)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if name in lm.config:
            continue  # the spec set it: the run's word
        value = getattr(tokenizer, name, None)  # else the tokenizer's, not the architecture's default
        setattr(model.config, name, value)
        setattr(model.generation_config, name, value)
    return model


def _tokenizer_dir(spec: RunSpec, given: Path | None, scratch: Path) -> Path:
    """The run's tokenizer: in ``given``, else where a peer keeps the run's data, else fetched
    from where the run publishes it into ``scratch``; checked against the spec's digest."""
    from peer.task.tokens import data_directory

    directory = Path(given) if given is not None else data_directory(spec)
    if given is None and not (directory / "tokenizer.json").is_file() and spec.data.url is not None:
        from peer.task.fetch import DataFetcher, parse_source

        assert spec.data.tokenizer is not None  # the spec enforces it for token runs
        fetcher = DataFetcher(parse_source(spec.data.url), scratch)
        try:
            fetcher.tokenizer(spec.data.tokenizer)
        finally:
            fetcher.close()
        directory = scratch
    digest = tokenizer_sha256(directory)
    if digest != spec.data.tokenizer:
        raise ConfigError(
            f"tokenizer mismatch: {directory / 'tokenizer.json'} is {digest}, the run uses {spec.data.tokenizer} "
            "(point --tokenizer at the directory of the run's tokenizer.json)"
        )
    return directory


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory}: transformers cannot load the tokenizer ({str(exc)[:160]})") from exc


def _bytegpt_as_gpt2(spec: RunSpec) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = spec.task.model
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=cfg.context,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=4 * cfg.d_model,
        activation_function="gelu",  # exact GELU, as F.gelu's default
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        return GPT2LMHeadModel(config).float()


_GPT2_NAMES = {
    "tok_emb.weight": ("transformer.wte.weight", False),
    "pos_emb.weight": ("transformer.wpe.weight", False),
    "ln_f.weight": ("transformer.ln_f.weight", False),
    "ln_f.bias": ("transformer.ln_f.bias", False),
    "head.weight": ("lm_head.weight", False),
}
_GPT2_BLOCK = {
    "ln1": ("ln_1", False),
    "ln2": ("ln_2", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "mlp.fc": ("mlp.c_fc", True),
    "mlp.proj": ("mlp.c_proj", True),
}


def gpt2_name(name: str) -> tuple[str, bool]:
    """A ByteGPT parameter's GPT-2 name, and whether its weight is transposed there (GPT-2's
    ``Conv1D`` stores ``in x out``, ``nn.Linear`` ``out x in``)."""
    if name in _GPT2_NAMES:
        return _GPT2_NAMES[name]
    _, index, rest = name.split(".", 2)  # blocks.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    target, transposed = _GPT2_BLOCK[module]
    return f"transformer.h.{index}.{target}.{kind}", transposed and kind == "weight"


@torch.no_grad()
def _load_bytegpt_state(model: torch.nn.Module, spec: RunSpec, params: torch.Tensor) -> None:
    source = ByteGPT(spec.task.model, device="meta")
    targets = dict(model.named_parameters())
    offset = 0
    for name, meta in source.named_parameters():
        values = params[offset : offset + meta.numel()].view(meta.shape)
        offset += meta.numel()
        target_name, transposed = gpt2_name(name)
        targets.pop(target_name).copy_(values.t() if transposed else values)
    assert not targets, f"GPT-2 parameters left unwritten: {sorted(targets)[:3]}"


def byte_tokenizer() -> Any:
    """A fast tokenizer whose ids are a text's UTF-8 bytes (0-255), no special tokens: the
    demo's byte model's vocabulary, in the form ``AutoTokenizer`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = _byte_chars()
    assert set(to_char.values()) == set(alphabet)
    vocab = {to_char[b]: b for b in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(VOCAB_SIZE):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(VOCAB_SIZE + extra)
            extra += 1
    return table
