"""Does the inner phase wait for the landing? (issue #29): ``python -m benchmarks.landing_overlap``.

Two real ``swarmtrain peer`` processes on loopback (one torch thread each, overlap on, a lossy
codec with error feedback) train a byte-GPT of ``--size`` for a few rounds, once with this
tree's code and once with a baseline git ref's (a temporary worktree). With overlap a round
lands while the next inner phase runs; what the training thread spends outside inner steps
is the round's ``host_s`` (launch preparation, the landing's part on the training thread,
recording). The baseline lands on the training thread; this code runs the landing's host half
on a landing thread (``landing_s``) and only re-bases the model between two inner steps.

Per code: median per round (rounds after the first, the second peer's too) of ``host_s``,
its parts where reported (``launch_s``, ``record_s``, the rest: the landing on the training
thread), ``landing_s``, ``compute_s`` and ``wait_s``; and the ratio of the training thread's
landing time, this code against the baseline (the baseline's = host_s − this code's launch
and record medians: its metrics do not split host_s). Writes
``benchmarks/results/landing-overlap.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.scale import REPO, RESULTS, SIZES, baseline_tree, run_peers

SPEC = """
[run]
name = "landing-{name}"
[task.model]
d_model = {d_model}
n_layers = {n_layers}
n_heads = 8
context = 64
[inner]
batch_size = 1
[rounds]
inner_steps = {steps}
[averaging]
compression = "4bit"
overlap = true
min_group_size = 2
matchmaking_timeout_s = 15.0
allreduce_timeout_s = 300.0
"""
KEYS = ("host_s", "launch_s", "record_s", "landing_s", "compute_s", "wait_s", "allreduce_s")


def run_pair(tree: Path, workdir: Path, size: str, steps: int, rounds: int) -> list[list[dict[str, Any]]]:
    """Two peers with the code in ``tree`` (``benchmarks.scale.run_peers``): their metrics rows."""
    d_model, n_layers = SIZES[size]
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(SPEC.format(name=size.lower(), d_model=d_model, n_layers=n_layers, steps=steps))
    run = run_peers(tree, spec, workdir, rounds, [])
    if any(run["codes"]):
        log = (workdir / "peer0.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"a peer failed (exit codes {run['codes']}): {log}")
    rows: list[list[dict[str, Any]]] = run["rows"]
    return rows


def summarize(code: str, rows: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over both peers' averaged rounds after the first (the first pays start-up)."""
    steady = [r for peer in rows for r in peer[1:] if r.get("averaged")]
    medians = {k: statistics.median(r[k] for r in steady) if steady and k in steady[0] else None for k in KEYS}
    return {
        "code": code,
        "rounds": len(steady) // 2,
        "agreed": all(a["state_digest"] == b["state_digest"] for a, b in zip(*rows)),
        **medians,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="200M", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-ref", default="c4d9a70")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-landing-") as tmp, contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_tree(args.baseline_ref, Path(tmp)))
        for tree, code in ((base, args.baseline_ref), (REPO, "current")):
            print(f"landing_overlap: {args.size} with {code} code", flush=True)
            results.append(summarize(code, run_pair(tree, Path(tmp) / code, args.size, args.steps, args.rounds)))
            print(json.dumps(results[-1]), flush=True)
    base_row, current = results
    launch_record = (current["launch_s"] or 0.0) + (current["record_s"] or 0.0)
    on_thread = {
        base_row["code"]: base_row["host_s"] - launch_record,
        "current": current["host_s"] - launch_record,
    }
    summary = {
        "size": args.size,
        "steps": args.steps,
        "rounds": args.rounds,
        "results": results,
        "landing_on_training_thread_s": on_thread,
        "ratio": on_thread["current"] / on_thread[base_row["code"]] if on_thread[base_row["code"]] > 0 else None,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "landing-overlap.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# The landing with overlap on: {args.size} byte-GPT, 2 peers on loopback, {args.steps} inner steps, "
        f"4bit with error feedback",
        "",
        f"Command: `python -m benchmarks.landing_overlap --size {args.size} --steps {args.steps} "
        f"--rounds {args.rounds} --baseline-ref {args.baseline_ref}` (medians per round after the first, both peers)",
        "",
        "| code | rounds | digests agree | " + " | ".join(KEYS) + " | landing on the training thread (s) |",
        "|---|---|---|" + "---|" * (len(KEYS) + 1),
    ]
    for row in results:
        cells = " | ".join("" if row[k] is None else f"{row[k]:.3f}" for k in KEYS)
        lines.append(f"| {row['code']} | {row['rounds']} | {row['agreed']} | {cells} | {on_thread[row['code']]:.3f} |")
    if summary["ratio"] is not None:
        lines += ["", f"Landing time on the training thread, current / {args.baseline_ref}: {summary['ratio']:.3f}"]
    (RESULTS / "landing-overlap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
