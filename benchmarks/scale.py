"""The peer's host cost as the model grows (issue #12): ``make bench-scale``.

For each model size, two real ``swarmtrain peer`` processes on loopback (one torch thread each,
overlap off so that every host step is on the critical path unless ``--overlaps`` says otherwise, fp16
averaging unless ``--codec``) run a few
rounds; the same runs with the code of a baseline git ref (checked out into a temporary
worktree) give the ratios. Reported per size and code version:

- peak host memory per peer: proportional set size (PSS) of the peer and all its child
  processes (hivemind's DHT and averager, p2pd), sampled every 0.25 s, ÷ fp32 model bytes; and
  the copies beyond the training state (params, grads, AdamW's two moments: 4 model sizes),
  also counted above the runtime floor (the peak PSS of the same code with a 0.14M-parameter
  model: Python, torch, hivemind's processes, p2pd), which is what grows with the model;
- host time per round ÷ GB of parameters: the metrics' ``host_s`` where the code reports it
  (launch preparation + landing), and for every version ``wall_s − compute_s − wait_s`` (what
  the baseline can say; it leaves out the launch's preparation), the comparable column;
- averaging throughput per peer: bytes sent × 8 ÷ all-reduce seconds.

Writes ``benchmarks/results/NAME.{md,json,png}`` (``--name``, default ``scale``). Usage:
``python -m benchmarks.scale [--sizes 10M,50M,200M] [--baseline-ref b276a6b] [--baseline-sizes 10M,50M]
[--codec sparse] [--overlaps off,whole,4] [--name scale-sparse]``.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swarmtrain.localswarm import wait_until

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SIZES = {
    "tiny": (64, 2),
    "10M": (256, 12),
    "50M": (512, 16),
    "85M": (768, 12),
    "200M": (1024, 16),
    "315M": (1280, 16),
    "1B": (2048, 20),
}
SPEC = """
[run]
name = "scale-{name}"
[task.model]
d_model = {d_model}
n_layers = {n_layers}
n_heads = 8
context = 64
[inner]
batch_size = 1
[rounds]
inner_steps = 2
[averaging]
compression = "{codec}"
overlap = {overlap}{in_turn}
min_group_size = 2
matchmaking_timeout_s = 10.0
allreduce_timeout_s = 300.0
"""


FLOOR_SIZE = "tiny"
"""The model (0.14M parameters, 0.1% of the floor) whose peak PSS stands for the runtime floor."""


def process_tree(root: int, *, include_root: bool = True) -> list[int]:
    """``root``'s descendants (and ``root`` itself unless ``include_root`` is False), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root] if include_root else list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_bytes(root: int, *, include_root: bool = True) -> int:
    """PSS of ``root`` (unless ``include_root`` is False) and every descendant (from /proc; 0
    for processes gone meanwhile)."""
    total = 0
    for pid in process_tree(root, include_root=include_root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def _peer(tree: Path, args: list[str], log: Path, cpu: int | None = None) -> subprocess.Popen[bytes]:
    """A ``swarmtrain peer`` process; ``cpu``: pinned with its children to that core, as a peer
    on a machine of its own (the other peer's work, a digest hashing in the background say, no
    longer takes its core)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "swarmtrain", "peer", *args],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=pin,
        )


def spec_text(name: str, codec: str = "fp16", overlap: str = "off") -> str:
    """The runs' spec for size ``name``; ``overlap``: ``off``, ``whole`` (overlap, the vector at
    once) or a count of fragments averaged in turn (overlap, ``averaging.sync_fragments``)."""
    d_model, n_layers = SIZES[name]
    in_turn = "" if overlap == "off" else f"\nsync_fragments = {1 if overlap == 'whole' else int(overlap)}"
    on = "false" if overlap == "off" else "true"
    return SPEC.format(name=name.lower(), d_model=d_model, n_layers=n_layers, codec=codec, overlap=on, in_turn=in_turn)


def run_pair(
    tree: Path, name: str, workdir: Path, rounds: int, codec: str = "fp16", pinned: bool = False, overlap: str = "off"
) -> dict[str, Any]:
    """Two peers of size ``name`` with the code in ``tree``: peak PSS and metrics rows of each."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(spec_text(name, codec, overlap))
    return run_peers(tree, spec, workdir, rounds, ["--no-overlap"] if overlap == "off" else [], pinned)


def run_peers(
    tree: Path, spec: Path, workdir: Path, rounds: int, extra: list[str], pinned: bool = False
) -> dict[str, Any]:
    """Two ``swarmtrain peer`` processes of ``spec`` with the code in ``tree`` (peer 1 joins peer
    0), ``rounds`` rounds with ``extra`` flags: peak PSS, metrics rows and exit code of each;
    ``pinned``: peer i on core i (of those this process may use)."""
    cores = sorted(os.sched_getaffinity(0))
    common = ["--spec", str(spec), "--host", "127.0.0.1", "--max-rounds", str(rounds), *extra]
    procs: list[subprocess.Popen[bytes]] = []
    peaks = [0, 0]
    first_log = workdir / "peer0.log"

    def first_maddr() -> str:
        lines = first_log.read_text(errors="replace").splitlines() if first_log.exists() else []
        return next((line.split()[1] for line in lines if line.startswith("listening: /ip4/127.0.0.1/")), "")

    try:
        for i in range(2):
            args = [*common, "--key", str(workdir / f"k{i}"), "--shard-seed", str(i)]
            args += ["--metrics-file", str(workdir / f"peer{i}.jsonl")]
            if i:
                wait_until(lambda: bool(first_maddr()) or procs[0].poll() is not None, 600, "peer 0 to listen")
                if not first_maddr():
                    raise RuntimeError(f"peer 0 exited: {first_log.read_text(errors='replace')[-2000:]}")
                args += ["--initial-peers", first_maddr()]
            procs.append(_peer(tree, args, workdir / f"peer{i}.log", cores[i % len(cores)] if pinned else None))
        deadline = time.monotonic() + 3600
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    peaks[i] = max(peaks[i], pss_bytes(proc.pid))
            time.sleep(0.25)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()
    rows = []
    for i in range(2):
        path = workdir / f"peer{i}.jsonl"
        rows.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return {"peak_pss": peaks, "rows": rows, "codes": [p.returncode for p in procs]}


def summarize(name: str, run: dict[str, Any], code: str, floor_bytes: int | None = None) -> dict[str, Any]:
    from protocol.modelsize import count_params
    from protocol.spec import parse_spec

    params = count_params(parse_spec(spec_text(name)).task.model)
    model_bytes = params * 4
    rows = [r for peer in run["rows"] for r in peer if r.get("averaged")]
    host = [r["host_s"] for r in rows if "host_s" in r] or [r["wall_s"] - r["compute_s"] - r["wait_s"] for r in rows]
    # what every version can say (it leaves out the launch's preparation): comparable across refs
    after_launch = [r["wall_s"] - r["compute_s"] - r["wait_s"] for r in rows]
    gbps = [r["bytes_sent"] * 8 / r["allreduce_s"] / 1e9 for r in rows if r.get("allreduce_s")]
    peak = max(run["peak_pss"])
    return {
        "size": name,
        "code": code,
        "params": params,
        "model_mb": model_bytes / 1e6,
        "peak_pss_gb": peak / 1e9,
        "pss_per_model": peak / model_bytes,
        "copies_beyond_training_state": peak / model_bytes - 4,
        "runtime_floor_gb": floor_bytes / 1e9 if floor_bytes else None,
        "copies_above_floor": (peak - floor_bytes) / model_bytes - 4 if floor_bytes else None,
        "host_s_per_round": statistics.median(host) if host else None,
        "host_s_per_gb": statistics.median(host) / (model_bytes / 1e9) if host else None,
        "after_launch_s_per_gb": statistics.median(after_launch) / (model_bytes / 1e9) if after_launch else None,
        "averaging_gbit_s": statistics.median(gbps) if gbps else None,
        "rounds_averaged": len(rows) // 2,
        "median_s": {
            key: statistics.median(r[key] for r in rows) if rows and key in rows[0] else None
            for key in ("compute_s", "wait_s", "allreduce_s", "host_s", "launch_s", "record_s", "digest_s", "wall_s")
        },
        "exit_codes": run["codes"],
        "host_s_rows": [r.get("host_s") for r in rows],
        "launch_s_rows": [r.get("launch_s") for r in rows],
    }


@contextlib.contextmanager
def baseline_tree(ref: str, parent: Path) -> Iterator[Path]:
    """The code of ``ref`` in a temporary git worktree under ``parent``, removed afterwards."""
    path = parent / f"baseline-{ref}"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "--detach", str(path), ref], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "remove", "--force", str(path)], check=False, capture_output=True)


def write(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (
        f"swarmtrain scale benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} CPUs), "
        f"2 peers on loopback, {args.codec}, overlap {args.overlaps} (baseline: off), one torch thread each"
        f"{', each pinned to a core of its own' if args.pinned else ''}; baseline {args.baseline_ref}; "
        f"`python -m benchmarks.scale --sizes {args.sizes} --baseline-sizes {args.baseline_sizes} "
        f"--codec {args.codec} --rounds {args.rounds} --overlaps {args.overlaps} --name {args.name}"
        f"{' --pinned' if args.pinned else ''}`"
    )
    lines = [
        header,
        "",
        "| size | code | params | peak PSS/peer | PSS ÷ model | copies beyond training state "
        "| same above the runtime floor | host s/round | host s/GB | wall−compute−wait s/GB (comparable) "
        "| averaging Gbit/s/peer | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        lines.append(
            f"| {r['size']} | {r['code']} | {r['params'] / 1e6:.1f}M | {r['peak_pss_gb']:.2f} GB | "
            f"{r['pss_per_model']:.1f} | {r['copies_beyond_training_state']:.1f} | "
            f"{fmt(r.get('copies_above_floor'), '.1f')} | {fmt(r['host_s_per_round'], '.2f')} | "
            f"{fmt(r['host_s_per_gb'], '.2f')} | {fmt(r.get('after_launch_s_per_gb'), '.2f')} | "
            f"{fmt(r['averaging_gbit_s'], '.2f')} | {r['rounds_averaged']} |"
        )
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for code in sorted({r["code"] for r in results}):
        mine = [r for r in results if r["code"] == code]
        x = [r["params"] / 1e6 for r in mine]
        for ax, key, label in zip(
            axes,
            ("pss_per_model", "host_s_per_gb", "averaging_gbit_s"),
            ("peak PSS ÷ fp32 model", "host s / GB / round", "averaging Gbit/s / peer"),
            strict=True,
        ):
            ax.plot(x, [r[key] or 0 for r in mine], marker="o", label=code)
            ax.set_xlabel("parameters (M)")
            ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,50M,85M,200M")
    parser.add_argument("--baseline-ref", default="b276a6b")
    parser.add_argument("--baseline-sizes", default="10M,50M,85M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="fp16", help="the runs' averaging.compression")
    parser.add_argument("--name", default="scale", help="results file name (benchmarks/results/NAME.{md,json,png})")
    parser.add_argument(
        "--overlaps",
        default="off",
        help="the current code's runs, comma-separated: off (the default), whole (overlap, the vector "
        "at once), or N (overlap, N fragments averaged in turn: averaging.sync_fragments)",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="each peer (and its processes) on a core of its own, as on machines of their own",
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-scale-") as tmp, contextlib.ExitStack() as stack:
        modes = [mode.strip() for mode in args.overlaps.split(",") if mode.strip()]
        plan = [(REPO, "current", s, mode) for mode in modes for s in args.sizes.split(",") if s]
        if args.baseline_sizes:
            base = stack.enter_context(baseline_tree(args.baseline_ref, Path(tmp)))
            plan += [(base, args.baseline_ref, s, "off") for s in args.baseline_sizes.split(",")]
        floors: dict[str, int] = {}
        for tree, code, size, mode in plan:
            if code not in floors:
                print(f"scale: runtime floor ({FLOOR_SIZE}) with {code} code", flush=True)
                floors[code] = max(run_pair(tree, FLOOR_SIZE, Path(tmp) / f"{code}-floor", 2)["peak_pss"])
            label = code if mode == "off" else f"{code}, overlap {mode if mode == 'whole' else f'in turn ({mode})'}"
            print(f"scale: {size} with {label}", flush=True)
            run = run_pair(tree, size, Path(tmp) / f"{code}-{mode}-{size}", args.rounds, args.codec, args.pinned, mode)
            results.append(summarize(size, run, label, floors[code]))
            print(json.dumps(results[-1]), flush=True)
            write(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
