"""How long a peer takes to build a causal-LM spec's model before its first step, by phase:
transformers' constructor (its own random init skipped), ``portable_init_`` on 1 thread and
on all of torch's, and the copy to the device. Writes ``benchmarks/results/model-init-<date>[-label].{md,json}``.

    python -m benchmarks.model_init --spec examples/llama-1b.toml --label h100
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.one_row import write_one_row
from peer.task import causal_lm
from peer.task.base import derive_seed
from peer.task.portable_init import portable_init_
from protocol.lm_shape import lm_shape
from protocol.modelsize import task_params
from protocol.spec import load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    lm = spec.task.causal_lm
    if lm is None or lm.weights is not None:
        raise SystemExit("the spec's task is not a causal_lm task initialised from its seed")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    seed = derive_seed(spec.data.seed, "model-init")
    result: dict[str, Any] = {"spec": str(args.spec), "params": task_params(spec), "threads": torch.get_num_threads()}
    t = time.perf_counter()
    model = causal_lm.build_lm_model(lm, seed=seed)
    result["build_lm_model_s"] = round(time.perf_counter() - t, 2)
    kwargs = dict(lm.config)
    kwargs["use_cache"] = False
    config = AutoConfig.for_model(lm.architecture, **kwargs)
    t = time.perf_counter()
    with no_init_weights():  # as build_lm_model builds it
        AutoModelForCausalLM.from_config(config, attn_implementation=lm.attention).float()
    result["constructor_without_init_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    AutoModelForCausalLM.from_config(config, attn_implementation=lm.attention).float()
    result["constructor_with_transformers_init_s"] = round(time.perf_counter() - t, 2)
    layers = lm_shape(lm.architecture, lm.config).layers
    std = float(getattr(config, "initializer_range", 0.02))
    for threads in sorted({1, torch.get_num_threads()}):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t = time.perf_counter()
            portable_init_(model, std=std, seed=seed, layers=layers)
            result[f"portable_init_{threads}_threads_s"] = round(time.perf_counter() - t, 2)
        finally:
            torch.set_num_threads(previous)
    if args.device != "cpu":
        t = time.perf_counter()
        model.to(args.device)
        torch.cuda.synchronize(args.device)
        result["to_device_s"] = round(time.perf_counter() - t, 2)
    name = f"model-init-{dt.date.today().isoformat()}{'-' + args.label if args.label else ''}"
    write_one_row(
        name,
        title=f"Model build time: {args.spec.name} ({result['params']:,} parameters), {result['threads']} threads",
        command=f"python -m benchmarks.model_init --spec {args.spec} --device {args.device}",
        result=result,
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
