"""Size and training cost of every task a spec can name, from the spec alone.

Shared by the peer (throughput figures, MFU) and the coordinator (compute credits, the
archive's vector size), which must agree on parameters and FLOPs per sample without the
coordinator importing torch, transformers or the model. A peer refuses to start when the
model it built has another parameter count than these formulas (``peer.cli``), so a formula
that drifts from transformers fails loudly instead of mis-crediting.

A transformers causal LM's shape and FLOPs: ``protocol.lm_shape``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.lm_shape import lm_flops_per_sample, lm_shape

if TYPE_CHECKING:
    from protocol.spec import ModelSection, RunSpec

VOCAB_SIZE = 256


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
