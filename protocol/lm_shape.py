"""The shape of a transformers causal LM from its architecture and config alone, without torch
or transformers: parameters, embeddings, a tied head, layers, attention width, maximum positions.
The spec checks a run's sequence length against it (``protocol.spec``); ``protocol.modelsize``
counts parameters and FLOPs from it.

FLOPs per sample of a causal LM (sequence of T tokens): 6 x (matmul parameters) x T for the
weights, plus 12 x layers x (attention width) x T² for attention scores and values (PaLM,
appendix B). The input embedding is a lookup, not a matmul: it is left out; the output
head is counted even when tied to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ConfigValues = Mapping[str, int | float | bool | str]


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
