"""ByteGPT: a GPT over raw bytes (vocabulary 256), sized by the spec's ``[task.model]``.

Token + learned position embeddings, ``n_layers`` pre-LayerNorm blocks (causal
self-attention through ``scaled_dot_product_attention(is_causal=True)``, 4x GELU MLP),
a final LayerNorm and an *untied* output head: untied keeps every parameter a distinct
tensor (simple flattening, state dicts and FSDP) and costs only 256 x d_model parameters.

``init_weights(seed)`` gives the same bytes on every machine (see ``portable_normal_``),
so all replicas of a run start bit-identical without downloading anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peer.task.portable_init import portable_init_
from protocol.modelsize import VOCAB_SIZE, count_params, flops_per_sample  # noqa: F401 - re-exported
from protocol.spec import ModelSection

INIT_STD = 0.02
Device = torch.device | str | None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelSection, device: Device = None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, device=device)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, device=device)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelSection, device: Device = None) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, device=device)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, device=device)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelSection, device: Device = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, device=device)
        self.attn = CausalSelfAttention(cfg, device)
        self.ln2 = nn.LayerNorm(cfg.d_model, device=device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """(batch, time) int64 bytes -> (batch, time, 256) logits; time <= cfg.context.

    Built with torch's default init; call ``init_weights`` (or use ``build_model``).
    ``device="meta"`` builds it without memory, e.g. to count parameters."""

    def __init__(self, cfg: ModelSection, device: Device = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.d_model, device=device)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model, device=device)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, device) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, device=device)
        self.head = nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False, device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        assert t <= self.cfg.context, f"sequence of {t} exceeds context {self.cfg.context}"
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, a pure function of ``seed`` (never the global RNG), through
        ``peer.task.portable_init``: weights ~N(0, 0.02²), residual output projections
        (``.proj``) scaled by 1/sqrt(2·n_layers), biases 0, LayerNorm scale 1."""
        portable_init_(self, std=INIT_STD, seed=seed, scaled=(".proj",), layers=self.cfg.n_layers)


def build_model(cfg: ModelSection, *, seed: int, device: str = "cpu") -> ByteGPT:
    """A ByteGPT initialised from ``seed`` alone on CPU (so the bytes do not depend on the
    device or the global RNG, which is left untouched), then moved to ``device``."""
    # torch's default init draws from the global RNG: restore it afterwards. (Building on
    # the meta device instead would cost ~1 s on first use: nn.Embedding there imports dynamo.)
    with torch.random.fork_rng(devices=[]):
        model = ByteGPT(cfg)
    model.init_weights(seed)
    return model.to(device)
