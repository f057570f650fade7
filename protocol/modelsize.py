"""Size and training cost of every task a spec can name, from the spec alone.

Shared by the peer (throughput figures, MFU) and the coordinator (compute credits, the
archive's vector size), which must agree on parameters and FLOPs per sample without the
coordinator importing torch, transformers or the model. A peer refuses to start when the
model it built has another parameter count than these formulas (``peer.cli``), so a formula
that drifts from transformers fails loudly instead of mis-crediting.

FLOPs per sample of a causal LM (sequence of T tokens): 6 x (matmul parameters) x T for the
weights, plus 12 x layers x (attention width) x T² for attention scores and values (PaLM,
appendix B). The input embedding is a lookup, not a matmul: it is left out; the output
head is counted even when tied to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # protocol.spec imports this module inside a validator
    from protocol.spec import ModelSection, RunSpec

VOCAB_SIZE = 256

ConfigValues = Mapping[str, int | float | bool | str]


LOSS_CHUNK_BYTES = 1 << 30
"""A causal LM's loss head (``peer.task.lm_head``) holds at most this many bytes of fp32 logits
at once: one chunk of tokens (~2,000 for a 128k vocabulary)."""


def loss_chunk_rows(vocab: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Most tokens per chunk of a ``vocab``-wide loss head within ``budget_bytes`` of fp32 logits."""
    return max(1, budget_bytes // (4 * vocab))


def count_params(cfg: ModelSection) -> int:
    """Parameters of ``ByteGPT(cfg)``, computed without building it."""
    d = cfg.d_model
    block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return VOCAB_SIZE * d + cfg.context * d + cfg.n_layers * block + 2 * d + d * VOCAB_SIZE


def flops_per_sample(cfg: ModelSection) -> float:
    """Training FLOPs of one sequence of ``cfg.context`` bytes: 6·N per token for the
    weights plus 12·n_layers·d_model·context per token for attention (PaLM, appendix B)."""
    t = cfg.context
    return float(6 * count_params(cfg) * t + 12 * cfg.n_layers * cfg.d_model * t * t)


@dataclass(frozen=True)
class LMShape:
    """What the parameter count and FLOPs of a transformers causal LM depend on."""

    params: int
    """Every parameter (a tied output head counted once, as ``model.parameters()`` does)."""
    embedding: int
    """Parameters of the input lookups (token and learned position embeddings)."""
    tied_head: int
    """Parameters of an output head tied to the token embedding (0 when untied)."""
    layers: int
    attention_width: int
    """Heads x head size: the width of the attention scores' contraction."""
    max_positions: int | None


_LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_GPT2_REQUIRED = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")


def lm_shape(architecture: str, config: ConfigValues) -> LMShape:
    """The shape of ``architecture`` built from ``config`` (transformers' keyword arguments).
    Raises ``ValueError`` naming a missing or bad key."""
    if architecture in ("llama", "mistral", "qwen2"):
        return _llama_like(architecture, config)
    if architecture == "gpt2":
        return _gpt2(config)
    raise ValueError(f"no parameter-count formula for architecture {architecture!r}")


def _int(config: ConfigValues, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"config.{key} is required (the parameter count depends on it)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.{key} must be a positive integer, got {value!r}")
    return value


def _flag(config: ConfigValues, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.{key} must be true or false, got {value!r}")
    return value


def _llama_like(architecture: str, config: ConfigValues) -> LMShape:
    for key in _LLAMA_REQUIRED:
        _int(config, key)
    v, d, ff = _int(config, "vocab_size"), _int(config, "hidden_size"), _int(config, "intermediate_size")
    layers, heads = _int(config, "num_hidden_layers"), _int(config, "num_attention_heads")
    kv = _int(config, "num_key_value_heads", heads)
    if heads % kv:
        raise ValueError(f"config.num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    head_dim = _int(config, "head_dim", d // heads if d % heads == 0 else None)
    qkv_bias = architecture == "qwen2" or _flag(config, "attention_bias", False)
    out_bias = architecture != "qwen2" and _flag(config, "attention_bias", False)
    mlp_bias = architecture == "llama" and _flag(config, "mlp_bias", False)
    tied = _flag(config, "tie_word_embeddings", False)
    attention = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d
    attention += (heads * head_dim + 2 * kv * head_dim) if qkv_bias else 0
    attention += d if out_bias else 0
    mlp = 3 * d * ff + ((2 * ff + d) if mlp_bias else 0)
    block = attention + mlp + 2 * d
    embedding = v * d
    params = embedding + layers * block + d + (0 if tied else v * d)
    positions = config.get("max_position_embeddings")
    return LMShape(
        params=params,
        embedding=embedding,
        tied_head=v * d if tied else 0,
        layers=layers,
        attention_width=heads * head_dim,
        max_positions=positions if isinstance(positions, int) and not isinstance(positions, bool) else None,
    )


def _gpt2(config: ConfigValues) -> LMShape:
    for key in _GPT2_REQUIRED:
        _int(config, key)
    v, d, layers, heads = (
        _int(config, "vocab_size"),
        _int(config, "n_embd"),
        _int(config, "n_layer"),
        _int(config, "n_head"),
    )
    positions = _int(config, "n_positions")
    inner = _int(config, "n_inner", 4 * d)
    if d % heads:
        raise ValueError(f"config.n_head ({heads}) must divide n_embd ({d})")
    tied = _flag(config, "tie_word_embeddings", True)
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    embedding = v * d + positions * d
    params = embedding + layers * block + 2 * d + (0 if tied else v * d)
    return LMShape(
        params=params,
        embedding=embedding,
        tied_head=v * d if tied else 0,
        layers=layers,
        attention_width=d,
        max_positions=positions,
    )


def lm_flops_per_sample(shape: LMShape, seq_len: int) -> float:
    """Training FLOPs of one sequence of ``seq_len`` tokens (see the module docstring)."""
    matmul = shape.params - shape.embedding + shape.tied_head
    return float(6 * matmul * seq_len + 12 * shape.layers * shape.attention_width * seq_len * seq_len)


def task_params(spec: RunSpec) -> int | None:
    """The task's parameter count from the spec alone (None: an imported task that declares none)."""
    task = spec.task
    if task.kind == "bytegpt":
        return count_params(task.model)
    if task.causal_lm is not None:
        return lm_shape(task.causal_lm.architecture, task.causal_lm.config).params
    return task.params


def task_flops_per_sample(spec: RunSpec) -> float:
    """Training FLOPs per sample of the spec's task, the same number on peer and coordinator
    (0 for an imported task that declares neither FLOPs nor parameters)."""
    task = spec.task
    if task.kind == "bytegpt":
        return flops_per_sample(task.model)
    if task.causal_lm is not None:
        lm = task.causal_lm
        return lm_flops_per_sample(lm_shape(lm.architecture, lm.config), lm.seq_len)
    if task.flops_per_sample is not None:
        return float(task.flops_per_sample)
    return float(6 * task.params) if task.params is not None else 0.0
