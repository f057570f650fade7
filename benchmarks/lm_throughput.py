"""Inner-step throughput of a causal-LM spec on this machine: tokens/s, MFU, peak memory.

What one volunteer's GPU contributes between two averaging rounds: the spec's model built
as a peer builds it (``peer.task.causal_lm.build_lm_model``: portable init, fp32 masters),
the spec's inner optimizer, micro-batches, activation checkpointing and autocast
(``peer.node.inner_step``), on random tokens (``peer.node.throughput``, which ``swarmtrain doctor`` uses
too; the data path is not what is measured). Prints and
writes a Markdown and JSON result to ``benchmarks/results/``.

    python -m benchmarks.lm_throughput --spec examples/llama-1b.toml --steps 20 --label h100
    python -m benchmarks.lm_throughput --spec examples/llama-tiny.toml --device cpu --steps 20
    python -m benchmarks.lm_throughput --spec examples/llama-1b.toml --micro-batches 2 --activation-checkpointing off

``--micro-batches``, ``--activation-checkpointing`` and ``--compile`` override the spec's (to
find what a GPU of this size should run; the result records what was measured). ``--profile``
records every kernel of the run (warm-up steps too) with torch.profiler and adds the GPU time by
kind of kernel (matrix products, attention, the rest) to the result; it slows the steps, so
its throughput is not the one to quote.

MFU = FLOPs per sample (``protocol.modelsize``, the figure credits use) x samples per second /
the device's peak dense bf16 FLOP/s (``--peak-tflops``; H100 SXM: 989).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
from pathlib import Path
from typing import Any

import torch

from benchmarks.one_row import write_one_row
from peer.node import throughput
from protocol.errors import ConfigError
from protocol.modelsize import task_params
from protocol.spec import RunSpec, load_spec, local_compute


def measure(spec: RunSpec, *, device: str, steps: int, warmup: int) -> dict[str, Any]:
    lm = spec.task.causal_lm
    if lm is None:
        raise SystemExit("the spec's task is not kind = 'causal_lm'")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    speed = throughput.measure(spec, device=device, steps=steps, warmup=warmup)
    return {
        "params": task_params(spec),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "precision": speed.precision,
        "seq_len": lm.seq_len,
        "batch_size": spec.inner.batch_size,
        "micro_batches": lm.micro_batches,
        "activation_checkpointing": lm.activation_checkpointing,
        "compile": lm.compile,
        "steps": speed.steps,
        "seconds": round(speed.seconds, 3),
        "step_s": round(speed.seconds / speed.steps, 4),
        "tokens_per_s": round(speed.tokens_per_s, 1),
        "tflops_per_s": round(speed.flops_per_s / 1e12, 3),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "init_s": round(speed.init_s, 2),
        "first_loss": round(speed.losses[0], 4),
        "last_loss": round(speed.losses[-1], 4),
    }


_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled (triton)", ("triton_",)),
)


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind, from its name: attention, matmul, optimizer, compiled, elementwise/other."""
    low = name.lower()
    return next((kind for kind, marks in _KINDS if any(mark in low for mark in marks)), "elementwise/other")


def profiled(run: Any) -> tuple[Any, dict[str, Any]]:
    """``run()``'s result and the GPU time of the kernels it launched, by kind and the top 12."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
    by_kind: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        us = float(getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0))
        if us <= 0:
            continue
        kind = kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
        top.append((us / 1e3, event.count, event.key[:90]))
    total = sum(by_kind.values()) or 1.0
    top.sort(reverse=True)
    return result, {
        "gpu_ms_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "gpu_share_by_kind": {k: round(v / total, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"ms": round(ms, 1), "calls": n, "name": name} for ms, n, name in top[:12]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak")
    parser.add_argument("--label", default="")
    parser.add_argument("--micro-batches", type=int, default=None, help="override the spec's micro_batches")
    parser.add_argument("--activation-checkpointing", choices=("on", "off"), default=None, help="override the spec's")
    parser.add_argument("--compile", choices=("on", "off"), default=None, help="override the spec's")
    parser.add_argument("--profile", action="store_true", help="also record GPU time by kind of kernel")
    args = parser.parse_args()
    checkpointing = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    compile_blocks = None if args.compile is None else args.compile == "on"
    try:
        spec = local_compute(
            load_spec(args.spec),
            micro_batches=args.micro_batches,
            checkpointing=checkpointing,
            compile_blocks=compile_blocks,
        )
    except ConfigError as exc:
        raise SystemExit(str(exc)) from exc
    run = lambda: measure(spec, device=args.device, steps=args.steps, warmup=args.warmup)  # noqa: E731
    if args.profile:
        result, kernels = profiled(run)
        result.update(kernels)
    else:
        result = run()
    result["spec"] = str(args.spec)
    if args.device.startswith("cuda"):
        result["mfu"] = round(result["tflops_per_s"] / args.peak_tflops, 4)
    name = f"lm-throughput-{dt.date.today().isoformat()}{'-' + args.label if args.label else ''}"
    command = (
        f"python -m benchmarks.lm_throughput --spec {args.spec} --device {args.device} --steps {args.steps}"
        + (f" --micro-batches {args.micro_batches}" if args.micro_batches is not None else "")
        + (f" --activation-checkpointing {args.activation_checkpointing}" if args.activation_checkpointing else "")
        + (f" --compile {args.compile}" if args.compile else "")
        + (" --profile" if args.profile else "")
    )
    write_one_row(
        name, title=f"Inner-step throughput: {args.spec.name} on {result['device']}", command=command, result=result
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
