"""Size and training cost of the built-in byte-level GPT, from its spec alone.

Shared by the peer (throughput figures) and the coordinator (compute credits), which must
agree on FLOPs per sample without the coordinator importing torch or the model.
"""

from __future__ import annotations

from protocol.spec import ModelSection

VOCAB_SIZE = 256


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
