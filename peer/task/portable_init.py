"""Initial weights that are the same bytes on every machine.

A seed alone does not make replicas identical: torch's CPU ``normal_`` runs a vectorised
Box-Muller whose log/cos differ between AVX2, AVX-512 and ARM, and CUDA draws other numbers
altogether. Every peer of a run must start from the same bits, so the built-in tasks
initialise through ``portable_normal_`` on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from protocol.errors import ConfigError

_CHUNK = 1 << 22
"""Values drawn at a time (16 MiB of float32)."""


@torch.no_grad()
def portable_normal_(tensor: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``tensor`` with ~N(0, std²) values that are the same bytes on every machine.

    The Irwin-Hall sum of 4 uniforms (``rand`` is integers x 2^-24: exact everywhere),
    centred and scaled with separate element-wise +, -, x ops, each correctly rounded
    whatever the SIMD width: a bell curve truncated at ±2·sqrt(3)·std.

    The four uniforms of every value are drawn as four passes over the tensor (the generator's
    stream is the same as one ``rand((4, *shape))``), summed in place in chunks: no temporary
    beyond one chunk, whatever the size (an embedding of 128K x 8K values is 4 GiB).
    """
    flat = tensor.view(-1)
    n = flat.numel()
    for start in range(0, n, _CHUNK):
        flat[start : start + _CHUNK].copy_(torch.rand(min(_CHUNK, n - start), generator=gen))
    for _ in range(3):
        for start in range(0, n, _CHUNK):
            flat[start : start + _CHUNK].add_(torch.rand(min(_CHUNK, n - start), generator=gen))
    flat.sub_(2.0).mul_(std * math.sqrt(3.0))  # Var(sum of 4 U(0,1)) = 1/3


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith("Norm")  # LayerNorm, LlamaRMSNorm, ...


def _is_projection(module: nn.Module) -> bool:
    # transformers' GPT-2 uses its own Conv1D (a Linear with transposed weight)
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D"


@torch.no_grad()
def portable_init_(model: nn.Module, *, std: float, seed: int, scaled: tuple[str, ...] = (), layers: int = 1) -> None:
    """Initialise every parameter of ``model`` from ``seed`` alone, in registration order:
    projection and embedding weights ~N(0, std²) (``portable_normal_``; those whose module
    name ends with one of ``scaled`` get std / sqrt(2 x layers), GPT-2's residual scaling),
    biases 0, normalisation scales 1. A parameter shared by two modules (a tied output head)
    is set once. Raises ``ConfigError`` for a module this rule does not know, rather than
    leaving it to torch's non-portable default."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    done: set[int] = set()
    for name, module in model.named_modules():
        own = [(pname, p) for pname, p in module.named_parameters(recurse=False) if id(p) not in done]
        if not own:
            continue
        if _is_projection(module):
            weight_std = std / math.sqrt(2 * layers) if name.endswith(scaled) and scaled else std
            for pname, param in own:
                if pname == "weight":
                    portable_normal_(param, weight_std, gen)
                else:
                    param.zero_()
        elif _is_norm(module):
            for pname, param in own:
                if pname == "weight":
                    param.fill_(1.0)
                else:
                    param.zero_()
        else:
            names = ", ".join(pname for pname, _ in own)
            raise ConfigError(f"cannot initialise {type(module).__name__} ({name}: {names}) identically on every peer")
        done.update(id(p) for _, p in own)
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    if missing:
        raise ConfigError(f"parameters left uninitialised: {missing[:5]}")
