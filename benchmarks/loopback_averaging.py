"""Averaging on loopback at the shipped defaults, the compiled codec kernels against the torch
reference in one run (issue #52: "loopback averaging at least 5 Gbit/s per peer with fp16 and at
least 2 with 4-bit").

Each trial is a fresh process holding two ``ExactAverager``s with their own hivemind DHT nodes
and p2p daemons (4 fragments, robust averaging, parts over libp2p or with ``--bulk on`` the bulk
channel), averaging a vector of ``--values`` values ``--rounds`` times after one untimed round;
the torch reference is the same code with ``SWARMTRAIN_CODEC_KERNELS=off``. Trials alternate
between the two (``--trials`` each), so a machine's drift lands on both. Throughput per peer is
what ``benchmarks.allreduce_parts`` reports: the bytes a peer sent × 8 ÷ its all-reduce seconds.

    python -m benchmarks.loopback_averaging --codecs fp16 4bit --values 20000000 --rounds 8 --trials 2

writes ``benchmarks/results/loopback-averaging[-LABEL].{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PATHS = {"kernels": "on", "reference": "off"}


def child(values: int, codec_name: str, rounds: int, bulk: bool) -> list[dict[str, float]]:
    """Runs in a fresh process: two averagers on loopback, one untimed round, then ``rounds``."""
    import torch
    from hivemind import DHT

    from engine.averager import ExactAverager
    from engine.bulk_settings import BulkSettings
    from engine.codecs import get_codec
    from engine.compression import choose_kernels
    from engine.process_memory import limit_malloc_arenas
    from engine.robust import RobustRule

    limit_malloc_arenas()  # as a peer's command line does, before any thread
    torch.set_num_threads(1)
    choose_kernels(values)  # as a peer does before its averager forks (loaded once, not in a round)
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in first.get_visible_maddrs()]
    )
    options: dict[str, Any] = dict(
        codec=get_codec(codec_name),
        prefix="loopback",
        start=True,
        min_group_size=2,
        target_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=300.0,
        streams=4,
        robust=RobustRule(),
        bulk=BulkSettings(enabled=bulk, host="127.0.0.1"),
    )
    averagers = [ExactAverager(values, dht, **options) for dht in (first, second)]
    try:
        for seed, averager in enumerate(averagers):
            with averager.get_tensors() as tensors:
                tensors[0].normal_(generator=torch.Generator().manual_seed(seed))
        rows = []
        for round_ in range(rounds + 1):
            controls = [a.step(wait=False, gather={}, timeout=120) for a in averagers]
            outcomes = [c.result() for c in controls]
            if round_ == 0:
                continue  # connections, allocations, compiled code loaded
            for outcome in outcomes:
                if outcome.failed or outcome.stats.missing:
                    raise RuntimeError(f"a round failed: {outcome.failed or outcome.stats.missing}")
                rows.append({"allreduce_s": outcome.stats.allreduce_s, "bytes_sent": outcome.stats.bytes_sent})
        return rows
    finally:
        for averager in averagers:
            averager.shutdown()
        first.shutdown()
        second.shutdown()


def run_trial(path: str, codec: str, args: argparse.Namespace) -> list[dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SWARMTRAIN_CODEC_KERNELS": PATHS[path]}
    argv = [sys.executable, "-m", "benchmarks.loopback_averaging", "--child", codec, "--values", str(args.values)]
    argv += ["--rounds", str(args.rounds), "--bulk", args.bulk]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {codec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows: list[dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    gbps = [r["bytes_sent"] * 8 / r["allreduce_s"] / 1e9 for r in rows]
    return {
        "gbit_s_per_peer": statistics.median(gbps),
        "allreduce_s": statistics.median(r["allreduce_s"] for r in rows),
        "mb_sent_per_peer": statistics.median(r["bytes_sent"] for r in rows) / 1e6,
        "samples": len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", nargs="+", default=["fp16", "4bit"])
    parser.add_argument("--values", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per trial (after one untimed)")
    parser.add_argument("--trials", type=int, default=2, help="trials per path and codec, alternating")
    parser.add_argument("--bulk", choices=("on", "off"), default="off", help="parts over the bulk channel")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--label", default="")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.values, args.child, args.rounds, args.bulk == "on")))
        return 0
    command = "python -m benchmarks.loopback_averaging " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for codec in args.codecs:
        rows: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
        for trial in range(args.trials):
            for path in PATHS if trial % 2 == 0 else reversed(PATHS):
                print(f"loopback averaging: {codec}, {path}, trial {trial + 1}", flush=True)
                rows[path] += run_trial(path, codec, args)
        figures = {path: summary(r) for path, r in rows.items()}
        ratio = figures["kernels"]["gbit_s_per_peer"] / figures["reference"]["gbit_s_per_peer"]
        results.append({"codec": codec, **{p: f for p, f in figures.items()}, "ratio": ratio})
        print(
            f"  {codec}: kernels {figures['kernels']['gbit_s_per_peer']:.2f} Gbit/s per peer, reference "
            f"{figures['reference']['gbit_s_per_peer']:.2f} ({ratio:.2f}x)",
            flush=True,
        )
    lines = [
        f"# Loopback averaging: compiled codec kernels against the torch reference ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command.strip()}` on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs): 2 averagers on "
        f"loopback, {args.values:,} values, shipped defaults (4 fragments, robust averaging, parts over "
        f"{'the bulk channel' if args.bulk == 'on' else 'libp2p'}), {args.trials} alternating trials of "
        f"{args.rounds} timed rounds per path. Per peer: bytes sent × 8 ÷ all-reduce seconds (median).",
        "",
        "| codec | kernels Gbit/s per peer | reference Gbit/s per peer | kernels ÷ reference "
        "| all-reduce s, kernels / reference | MB sent per peer |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        k, ref = r["kernels"], r["reference"]
        lines.append(
            f"| {r['codec']} | {k['gbit_s_per_peer']:.2f} | {ref['gbit_s_per_peer']:.2f} | {r['ratio']:.2f}x "
            f"| {k['allreduce_s']:.3f} / {ref['allreduce_s']:.3f} | {k['mb_sent_per_peer']:.1f} |"
        )
    stem = "loopback-averaging" + (f"-{args.label}" if args.label else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    print(f"wrote {args.out / stem}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
