"""Initial weights that are the same bytes on every machine.

A seed alone does not make replicas identical: torch's CPU ``normal_`` runs a vectorised
Box-Muller whose log/cos differ between AVX2, AVX-512 and ARM, and CUDA draws other numbers
altogether. Every peer of a run must start from the same bits, so the built-in tasks
initialise through ``portable_normal_`` on CPU.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from protocol.errors import ConfigError

_BLOCK = 1 << 22
"""Values drawn from one generator (16 MiB of float32): a parameter's values are drawn in
blocks of this many, each from its own generator, so blocks are drawn in parallel."""


def _derive(seed: int, *parts: object) -> int:
    """A 63-bit seed derived from ``seed`` and ``parts`` (blake2b: the same on every machine)."""
    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()  # grad mode is per thread: the pool's threads need it too (parameters require grad)
def _fill_block(block: torch.Tensor, std: float, seed: int) -> None:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    n = block.numel()
    block.copy_(torch.rand(n, generator=gen))
    for _ in range(3):
        block.add_(torch.rand(n, generator=gen))
    block.sub_(2.0).mul_(std * math.sqrt(3.0))  # Var(sum of 4 U(0,1)) = 1/3


@torch.no_grad()
def portable_normal_(tensor: torch.Tensor, std: float, seed: int, *, workers: int | None = None) -> None:
    """Fill ``tensor`` (contiguous, CPU) with ~N(0, std²) values that are the same bytes on
    every machine, whatever its SIMD width or core count.

    Each value is the Irwin-Hall sum of 4 uniforms (``rand`` is integers x 2^-24: exact
    everywhere), centred and scaled with separate element-wise +, -, x ops, each correctly
    rounded: a bell curve truncated at ±2·sqrt(3)·std. Block ``b`` (``_BLOCK`` values) draws its
    four uniforms per value from a generator seeded by (``seed``, ``b``) alone, so the blocks
    are drawn on ``workers`` threads at once (default: torch's intra-op thread count; torch
    releases the GIL) and the result does not depend on how many: the sequential Mersenne
    Twister was 17 s of a 1.2B model's build on one core. No temporary beyond one block per
    thread, whatever the size (an embedding of 128K x 8K values is 4 GiB).
    """
    flat = tensor.view(-1)
    starts = range(0, flat.numel(), _BLOCK)
    jobs = [(flat[start : start + _BLOCK], _derive(seed, "block", i)) for i, start in enumerate(starts)]
    threads = max(1, min(len(jobs), workers or torch.get_num_threads()))
    if threads == 1:
        for block, block_seed in jobs:
            _fill_block(block, std, block_seed)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="portable-init") as pool:
        for done in [pool.submit(_fill_block, block, std, block_seed) for block, block_seed in jobs]:
            done.result()


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith("Norm")  # LayerNorm, LlamaRMSNorm, ...


def _is_projection(module: nn.Module) -> bool:
    # transformers' GPT-2 uses its own Conv1D (a Linear with transposed weight)
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D"


@torch.no_grad()
def portable_init_(model: nn.Module, *, std: float, seed: int, scaled: tuple[str, ...] = (), layers: int = 1) -> None:
    """Initialise every parameter of ``model`` from ``seed`` alone, in registration order (the
    n-th drawn weight from its own seed, derived from (``seed``, n)):
    projection and embedding weights ~N(0, std²) (``portable_normal_``; those whose module
    name ends with one of ``scaled`` get std / sqrt(2 x layers), GPT-2's residual scaling),
    biases 0, normalisation scales 1. A parameter shared by two modules (a tied output head)
    is set once. Raises ``ConfigError`` for a module this rule does not know, rather than
    leaving it to torch's non-portable default."""
    done: set[int] = set()
    drawn = 0  # the how-manieth drawn tensor: its seed is (seed, drawn)
    for name, module in model.named_modules():
        own = [(pname, p) for pname, p in module.named_parameters(recurse=False) if id(p) not in done]
        if not own:
            continue
        if _is_projection(module):
            weight_std = std / math.sqrt(2 * layers) if name.endswith(scaled) and scaled else std
            for pname, param in own:
                if pname == "weight":
                    portable_normal_(param, weight_std, _derive(seed, "tensor", drawn))
                    drawn += 1
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
