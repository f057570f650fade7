"""Averaging on loopback at the shipped defaults, the compiled codec kernels against the torch
reference in one run (issue #52: "loopback averaging at least 5 Gbit/s per peer with fp16 and at
least 2 with 4-bit").

Each trial is a fresh process holding two ``ExactAverager``s with their own hivemind DHT nodes
and p2p daemons (4 fragments, robust averaging, parts over libp2p or with ``--bulk on`` the bulk
channel), averaging a vector of ``--values`` values ``--rounds`` times after one untimed round;
the torch reference is the same code with ``SWARMTRAIN_CODEC_KERNELS=off``; with
``--baseline-ref REF``, REF's code (in a temporary worktree, kernels on) instead. Trials alternate
between the two (``--trials`` each), so a machine's drift lands on both. Throughput per peer is
what ``benchmarks.allreduce_parts`` reports: the bytes a peer sent × 8 ÷ its all-reduce seconds;
and per CPU second, the bytes sent × 8 ÷ the averager process's CPU seconds in the round (on 2
cores shared by 2 averagers the first is bound by the second).

    python -m benchmarks.loopback_averaging --codecs fp16 4bit --values 20000000 --rounds 8 --trials 2
    python -m benchmarks.loopback_averaging --codecs fp16 --bulk on --baseline-ref REF --transport

``--transport`` adds the bulk channel's transport alone (``benchmarks.bulk_transport``): what one
CPU second carries with no averaging at all, the bound of the all-reduce's figure per CPU second.

writes ``benchmarks/results/loopback-averaging[-LABEL].{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.scale import baseline_tree

REPO = Path(__file__).resolve().parents[1]


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
            before = [cpu_seconds(a.pid) for a in averagers]
            controls = [a.step(wait=False, gather={}, timeout=120) for a in averagers]
            outcomes = [c.result() for c in controls]
            spent = [cpu_seconds(a.pid) - b for a, b in zip(averagers, before, strict=True)]
            if round_ == 0:
                continue  # connections, allocations, compiled code loaded
            for outcome, cpu_s in zip(outcomes, spent, strict=True):
                if outcome.failed or outcome.stats.missing:
                    raise RuntimeError(f"a round failed: {outcome.failed or outcome.stats.missing}")
                stats = outcome.stats
                rows.append({"allreduce_s": stats.allreduce_s, "bytes_sent": stats.bytes_sent, "cpu_s": cpu_s})
        return rows
    finally:
        for averager in averagers:
            averager.shutdown()
        first.shutdown()
        second.shutdown()


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used: an averager's
    matchmaking, codecs, reducer and transport (the bulk channel's TLS is in it; libp2p's parts
    would be in its p2pd, not counted)."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_trial(path: Path, kernels: str, codec: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """One trial in a fresh process, the product code from ``path`` (this checkout or a baseline
    worktree) driven by this file's ``child``, the codec kernels ``on`` or ``off``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(path), "SWARMTRAIN_CODEC_KERNELS": kernels}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", codec, "--values", str(args.values)]
    argv += ["--rounds", str(args.rounds), "--bulk", args.bulk]
    done = subprocess.run(argv, cwd=path, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {codec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows: list[dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    gbps = [r["bytes_sent"] * 8 / r["allreduce_s"] / 1e9 for r in rows]
    cpu = [r["cpu_s"] for r in rows if "cpu_s" in r]
    return {
        "gbit_s_per_peer": statistics.median(gbps),
        # what one core of this machine would carry per peer if the averager's work were all
        # there was: bytes sent x 8 / its CPU seconds (the machine's 2 cores hold 2 averagers)
        "gbit_per_cpu_s": statistics.median(r["bytes_sent"] * 8 / r["cpu_s"] / 1e9 for r in rows) if cpu else 0.0,
        "cpu_s_per_round": statistics.median(cpu) if cpu else 0.0,
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
    parser.add_argument(
        "--baseline-ref",
        default=None,
        help="compare this code with a git ref's (kernels on both) instead of the torch reference",
    )
    parser.add_argument(
        "--transport",
        action="store_true",
        help="also measure the bulk channel's transport alone (benchmarks.bulk_transport), this code's",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.values, args.child, args.rounds, args.bulk == "on")))
        return 0
    command = "python -m benchmarks.loopback_averaging " + " ".join(argv if argv is not None else sys.argv[1:])
    with contextlib.ExitStack() as stack:
        if args.baseline_ref:
            tree = stack.enter_context(baseline_tree(args.baseline_ref, Path(tempfile.mkdtemp(prefix="loopback-"))))
            paths = {"this code": (REPO, "on"), args.baseline_ref: (tree, "on")}
        else:
            paths = {"kernels": (REPO, "on"), "reference": (REPO, "off")}
        results = []
        for codec in args.codecs:
            rows: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
            for trial in range(args.trials):
                for name in list(paths) if trial % 2 == 0 else reversed(paths):
                    print(f"loopback averaging: {codec}, {name}, trial {trial + 1}", flush=True)
                    rows[name] += run_trial(*paths[name], codec, args)
            figures = {name: summary(r) for name, r in rows.items()}
            new, old = (figures[name] for name in paths)
            ratio = new["gbit_s_per_peer"] / old["gbit_s_per_peer"]
            results.append({"codec": codec, **figures, "ratio": ratio})
            print(
                f"  {codec}: "
                + ", ".join(f"{n} {f['gbit_s_per_peer']:.2f} Gbit/s per peer" for n, f in figures.items())
            )
    transport = None
    if args.transport:  # (imported here: a baseline's child runs this file with another tree's modules)
        from benchmarks.bulk_transport import transport_gbit_per_cpu_s

        transport = transport_gbit_per_cpu_s()
    first, second = paths
    what = f"this code against {second}" if args.baseline_ref else "compiled codec kernels against the torch reference"
    lines = [
        f"# Loopback averaging: {what} ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command.strip()}` on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs): 2 averagers on "
        f"loopback, {args.values:,} values, shipped defaults (4 fragments, robust averaging, parts over "
        f"{'the bulk channel' if args.bulk == 'on' else 'libp2p'}), {args.trials} alternating trials of "
        f"{args.rounds} timed rounds per path. Per peer: bytes sent × 8 ÷ all-reduce seconds (median); per CPU "
        "second: bytes sent × 8 ÷ the averager process's CPU seconds in the round (what one of this machine's "
        "cores carries per peer when it does nothing else; 2 averagers share its 2 cores here).",
        "",
        f"| codec | {first} Gbit/s per peer | {second} Gbit/s per peer | ratio | all-reduce s, {first} / {second} "
        f"| Gbit per CPU s, {first} / {second} | averager CPU s per round, {first} / {second} | MB sent per peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b = r[first], r[second]
        lines.append(
            f"| {r['codec']} | {a['gbit_s_per_peer']:.2f} | {b['gbit_s_per_peer']:.2f} | {r['ratio']:.2f}x "
            f"| {a['allreduce_s']:.3f} / {b['allreduce_s']:.3f} | {a['gbit_per_cpu_s']:.2f} / {b['gbit_per_cpu_s']:.2f} "
            f"| {a['cpu_s_per_round']:.3f} / {b['cpu_s_per_round']:.3f} | {a['mb_sent_per_peer']:.1f} |"
        )
    if transport is not None:
        shares = ", ".join(
            f"{r['codec']} {r[first]['gbit_per_cpu_s'] / transport['gbit_per_cpu_s']:.0%}" for r in results
        )
        lines += [
            "",
            f"The transport alone (`python -m benchmarks.bulk_transport`: the bulk channel's TLS connection and "
            f"frames of {transport['frame_bytes'] / 1024:.0f} KiB, both ends in one thread, nothing done with the "
            f"bytes; median of {len(transport['spread'])} runs, {transport['spread']}): "
            f"**{transport['gbit_per_cpu_s']:.2f} Gbit per CPU second**, sending and receiving each byte once, as "
            f"an averager does each byte it counts as sent. The all-reduce reaches, per CPU second, this share of "
            f"it ({first}): {shares}; the rest of its CPU is the averaging around the transport. One core per "
            f"peer carries at most the transport's figure per peer, however cheap the averaging gets.",
        ]
    stem = "loopback-averaging" + (f"-{args.label}" if args.label else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(
        json.dumps({"command": command, "results": results, "transport": transport}, indent=1)
    )
    print(f"wrote {args.out / stem}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
