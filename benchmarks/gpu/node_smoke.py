"""A node of local ranks on a GPU (issue #29's NCCL/FSDP2 smoke run): the demo spec, a 1-rank
partner and a node with ``--nproc-per-node N`` (``--fsdp on`` and ``--fsdp off``: FSDP2 shards
and DDP over NCCL), standalone, a few rounds; per round whether both averaged with equal digests.

    python -m benchmarks.gpu.node_smoke --out DIR [--nproc 1] [--rounds 3]

Writes ``DIR/node_smoke.json`` and each peer's log; exits non-zero when a variant fails."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from swarmtrain.localswarm import LocalPeer, wait_all

REPO = Path(__file__).resolve().parents[2]


def run_variant(out: Path, fsdp: str, nproc: int, rounds: int) -> dict[str, Any]:
    """One partner and one node of ``nproc`` ranks (``--fsdp fsdp``) for ``rounds`` rounds."""
    work = out / f"fsdp-{fsdp}"
    work.mkdir(parents=True, exist_ok=True)
    common = ["--spec", str(REPO / "examples/demo.toml"), "--host", "127.0.0.1", "--max-rounds", str(rounds)]
    started = time.monotonic()
    partner = LocalPeer([*common, "--key", str(work / "partner.key"), "--shard-seed", "5"], work, "partner")
    node = None
    try:
        node = LocalPeer(
            [*common, "--key", str(work / "node.key"), "--shard-seed", "7", "--initial-peers", partner.wait_for_maddr()]
            + ["--nproc-per-node", str(nproc), "--fsdp", fsdp],
            work,
            "node",
        )
        codes = wait_all((partner, node), 240)
    finally:
        for peer in (partner, node):
            if peer is not None:
                peer.kill()
    assert node is not None
    pairs = list(zip(partner.rounds(), node.rounds()))
    agreed = [
        a.get("averaged")
        and b.get("averaged")
        and a.get("state_digest") is not None
        and a.get("state_digest") == b.get("state_digest")
        for a, b in pairs
    ]
    return {
        "fsdp": fsdp,
        "nproc": nproc,
        "exit": {"partner": codes[0], "node": codes[1]},
        "rounds": len(pairs),
        "agreed": agreed,
        "node_lines": [line for line in node.lines if line.startswith(("model:", "node:"))][:4],
        "seconds": round(time.monotonic() - started, 1),
        "ok": codes == [0, 0] and len(pairs) == rounds and all(agreed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = []
    for fsdp in ("on", "off"):
        try:
            results.append(run_variant(args.out, fsdp, args.nproc, args.rounds))
        except (AssertionError, OSError, TimeoutError, RuntimeError) as exc:  # the other variant still runs
            results.append({"fsdp": fsdp, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(results[-1]), flush=True)
    (args.out / "node_smoke.json").write_text(json.dumps(results, indent=1))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
