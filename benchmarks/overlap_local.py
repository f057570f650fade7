"""Compute vs. waiting per round, overlap on and off, on a local 3-peer swarm (loopback).

    python -m benchmarks.overlap_local [--rounds 8] [--codec int8] [--d-model 128]

Runs the same spec twice (averaging.overlap = false, then true) with 3 `swarmtrain peer`
processes on this machine and prints, per mode, the mean per-round compute_s, wait_s and
utilisation = compute / (compute + wait), from the peers' --metrics-file rows. Loopback has
no bandwidth limit: this measures the protocol's own stalls, not a WAN (see issue #5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from swarmtrain.localswarm import start_peers

SPEC = """
[run]
name = "overlap-bench"
[task.model]
d_model = {d_model}
n_layers = 2
n_heads = 4
context = 64
[inner]
lr = 2e-3
batch_size = 8
[rounds]
inner_steps = {steps}
[averaging]
compression = "{codec}"
overlap = {overlap}
min_group_size = 3
matchmaking_timeout_s = 6.0
allreduce_timeout_s = 30.0
"""


def measure(workdir: Path, *, overlap: bool, args: argparse.Namespace) -> dict[str, float]:
    spec = workdir / "spec.toml"
    spec.write_text(SPEC.format(d_model=args.d_model, steps=args.steps, codec=args.codec, overlap=str(overlap).lower()))
    peers = start_peers(spec, 3, workdir, extra=["--max-rounds", str(args.rounds)])
    try:
        for peer in peers:
            if peer.wait(timeout=900) != 0:
                raise SystemExit(f"{peer.name} failed; see {peer.log}")
    finally:
        for peer in peers:
            peer.kill()
    rows = [row for peer in peers for row in peer.rounds()[1:]]  # round 1 includes start-up
    compute = statistics.mean(r["compute_s"] for r in rows)
    wait = statistics.mean(r["wait_s"] for r in rows)
    return {"compute_s": compute, "wait_s": wait, "utilization": compute / (compute + wait), "rounds": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--d-model", type=int, default=128)
    args = parser.parse_args()
    print("| overlap | compute_s / round | wait_s / round | utilisation | rounds measured |")
    print("|---|---|---|---|---|")
    for overlap in (False, True):
        with tempfile.TemporaryDirectory(prefix="swarmtrain-overlap-") as tmp:
            m = measure(Path(tmp), overlap=overlap, args=args)
        print(
            f"| {'on' if overlap else 'off'} | {m['compute_s']:.3f} | {m['wait_s']:.3f} | "
            f"{100 * m['utilization']:.1f}% | {m['rounds']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
