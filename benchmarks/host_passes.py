"""A round's host passes alone, on one core (or ``--threads``), the compiled kernels against the torch reference in
one run (issue #53: "host time per round ≤ 0.5 s/GB").

For each codec, a fresh process per path (``SWARMTRAIN_CODEC_KERNELS=on`` or ``off``) builds a
model of ``--params`` float32 values (square linear layers), a global state and an error
feedback, then times the best of ``--rounds`` launches (``write_pseudo_gradient``: Δ plus the
residual) and landings (``land_round``: the residual, the outer Nesterov step, θ_local ← θ_g),
without overlap, with overlap landed by ``land_round``, and with overlap as the peer lands it by
default (``copy_model_into`` + ``write_delta_from``; ``land_global`` + ``rebase_model``: the
landing thread's halves), in seconds per GB of parameters. Nothing else runs: this is the
passes' own cost, where ``benchmarks.scale`` shows them inside two peers sharing two cores.

    python -m benchmarks.host_passes --params 50000000 --codecs fp16 int8 4bit sparse

writes ``benchmarks/results/host-passes[-LABEL].{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PATHS = {"kernels": "on", "reference": "off"}
MODES = ("no_overlap", "overlap", "landing_thread")
"""No overlap; overlap landed by ``land_round`` on the training thread; overlap as the peer lands
it by default (``host_thread``): ``land_global`` on the landing thread, then ``rebase_model``."""


def child(params: int, codec_name: str, rounds: int, threads: int) -> dict[str, float]:
    import torch

    from engine.codecs import get_codec
    from engine.compression import ErrorFeedback
    from peer.round.host_passes import (
        Staging,
        copy_model_into,
        land_global,
        land_round,
        rebase_model,
        write_delta_from,
        write_pseudo_gradient,
    )
    from peer.round.state import GlobalState, flatten
    from protocol.spec import OuterSection

    torch.set_num_threads(threads)  # the kernels' threads (engine.kernels.threads) and torch's alike
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    numel = sum(p.numel() for p in model.parameters())
    codec = get_codec(codec_name)
    state = GlobalState(flatten(model), torch.zeros(numel), 0)
    feedback = ErrorFeedback(codec, numel) if codec.lossy else None
    out, averaged = torch.empty(numel), torch.empty(numel)
    staging, config = Staging(model), OuterSection(lr=0.7, momentum=0.9, nesterov=True)
    gb = numel * 4 / 1e9
    figures: dict[str, float] = {"params": float(numel)}
    for mode in MODES:
        launch_point = torch.empty(numel) if mode != "no_overlap" else None
        launches, landings = [], []
        for _ in range(rounds + 1):  # the first warms up (pages, compiled code)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            started = time.perf_counter()
            if mode == "landing_thread":  # the peer's overlap (host_thread): the launch point, then Δ from it
                assert launch_point is not None
                copy_model_into(model, launch_point)
                write_delta_from(launch_point, state.params, out, feedback=feedback)
            else:
                write_pseudo_gradient(
                    model, state.params, out, feedback=feedback, launch_point=launch_point, staging=staging
                )
            launched = time.perf_counter()
            averaged.copy_(out)
            landing = time.perf_counter()
            bound = codec.at_round(state.round)
            if mode == "landing_thread":  # the host half, then the model's re-base between two steps
                assert launch_point is not None
                land_global(state, averaged, config, feedback=feedback, launch_point=launch_point, codec=bound)
                rebase_model(model, launch_point)
                state.round += 1
            else:
                land_round(
                    model, state, averaged, config, feedback=feedback, launch_point=launch_point,
                    keep_progress=mode == "overlap", staging=staging, codec=bound,
                )  # fmt: skip
            landed = time.perf_counter()
            launches.append(launched - started)
            landings.append(landed - landing)
        figures[f"launch_s_per_gb_{mode}"] = min(launches[1:]) / gb
        figures[f"landing_s_per_gb_{mode}"] = min(landings[1:]) / gb
    return figures


def run(path: str, codec: str, args: argparse.Namespace) -> dict[str, float]:
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(REPO), "SWARMTRAIN_CODEC_KERNELS": PATHS[path]}
    argv = [sys.executable, "-m", "benchmarks.host_passes", "--child", codec]
    argv += ["--params", str(args.params), "--rounds", str(args.rounds), "--threads", threads]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {codec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--codecs", nargs="+", default=["fp16", "int8", "4bit", "sparse"])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (the best counts)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads for both paths (1: one core's cost; a peer takes all its cores)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.params, args.child, args.rounds, args.threads)))
        return 0
    command = "python -m benchmarks.host_passes " + " ".join(argv if argv is not None else sys.argv[1:])
    results: list[dict[str, Any]] = []
    for codec in args.codecs:
        row: dict[str, Any] = {"codec": codec}
        for path in PATHS:
            print(f"host passes: {codec}, {path}", flush=True)
            row[path] = run(path, codec, args)
        results.append(row)
        for mode in MODES:
            k, r = row["kernels"], row["reference"]
            total_k = k[f"launch_s_per_gb_{mode}"] + k[f"landing_s_per_gb_{mode}"]
            total_r = r[f"launch_s_per_gb_{mode}"] + r[f"landing_s_per_gb_{mode}"]
            print(f"  {codec} {mode}: kernels {total_k:.2f} s/GB, reference {total_r:.2f} ({total_r / total_k:.2f}x)")
    params = results[0]["kernels"]["params"] if results else 0
    lines = [
        f"# A round's host passes: compiled kernels against the torch reference ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command.strip()}` on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), {args.threads} thread{'s' if args.threads > 1 else ''}, "
        f"{params:,.0f} parameters, nothing else running: the best of {args.rounds} rounds per mode, s per GB "
        "of parameters (launch: Δ plus the residual; landing: the residual, the outer Nesterov step, the model).",
        "",
        "| codec | overlap | launch, kernels / reference | landing, kernels / reference "
        "| launch + landing, kernels / reference | reference ÷ kernels |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        k, r = row["kernels"], row["reference"]
        for mode, label in (("no_overlap", "off"), ("overlap", "on"), ("landing_thread", "on, landing thread")):
            lk, lr = k[f"launch_s_per_gb_{mode}"], r[f"launch_s_per_gb_{mode}"]
            dk, dr = k[f"landing_s_per_gb_{mode}"], r[f"landing_s_per_gb_{mode}"]
            lines.append(
                f"| {row['codec']} | {label} | {lk:.2f} / {lr:.2f} | {dk:.2f} / {dr:.2f} | {lk + dk:.2f} / {lr + dr:.2f} "
                f"| {(lr + dr) / (lk + dk):.2f}x |"
            )
    stem = "host-passes" + (f"-{args.label}" if args.label else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    print(f"wrote {args.out / stem}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
