"""``swarmtrain demo``: a coordinator and three local CPU peers train the demo model, then a summary.

Starts a `swarmtrain coordinator` (SQLite) and 3 `swarmtrain peer --coordinator` processes on
loopback with the embedded demo spec
(``swarmtrain/demo.toml``, also at ``examples/demo.toml``), shows the swarm's progress,
and prints rounds, loss first → last, whether every round's digests agreed, and samples
and bytes and verified credits per peer. Leaves no process behind, on success, failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from protocol.errors import SwarmtrainError

PEERS = 3


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="a coordinator and 3 local CPU peers train a tiny model, then a summary",
        description="Run a local swarm of 3 CPU peers on the embedded demo spec and summarise it.",
    )
    parser.add_argument("--spec", type=Path, default=None, help="run spec (default: the embedded demo spec)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds to train (default: the spec's max_rounds)")
    parser.add_argument("--summary-json", type=Path, default=None, help="also write the summary here as JSON")
    parser.add_argument("--workdir", type=Path, default=None, help="keep keys, logs and metrics here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from protocol.spec import load_spec
    from swarmtrain.localswarm import LocalCoordinator, start_peers

    spec_path = args.spec or Path(str(resources.files("swarmtrain") / "demo.toml"))
    spec = load_spec(spec_path)
    rounds = args.rounds or spec.rounds.max_rounds or 10
    if rounds < 1:
        raise SwarmtrainError(f"--rounds must be >= 1, got {rounds}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarmtrain-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"demo: a coordinator and {PEERS} peers on this machine train {spec.run.name!r} for {rounds} rounds")
    print(f"demo: logs, keys and the coordinator's SQLite database in {workdir}", flush=True)
    coordinator = LocalCoordinator(spec_path, workdir / "coordinator")
    peers: list[Any] = []
    try:
        address = coordinator.address()
        print(f"demo: dashboard at {coordinator.http()} while it runs", flush=True)
        peers = start_peers(spec_path, PEERS, workdir, extra=["--max-rounds", str(rounds)], coordinator=address)
        _show_progress(peers, rounds)
        codes = [peer.wait(timeout=120) for peer in peers]
        credits = _credits(workdir, [peer.node_id() for peer in peers])
    except KeyboardInterrupt:
        print("\ndemo: interrupted; stopping the peers and the coordinator", file=sys.stderr)
        for peer in peers:
            peer.stop(grace_s=15)
        return 130
    finally:
        for peer in peers:
            peer.kill()
        coordinator.stop()
    summary = summarize([peer.rounds() for peer in peers], codes)
    for row in summary["peers"]:
        row["credited_samples"], row["credited_flops"] = credits.get(row["peer"], (0, 0.0))
    _print_summary(summary)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0 if summary["ok"] else 1


def _credits(workdir: Path, node_ids: list[str], deadline_s: float = 90.0) -> dict[int, tuple[int, float]]:
    """Credits per peer index (by the node key each peer printed) once the coordinator decided
    every claim (or the deadline)."""
    from coordinator.store import Store, sqlite_url

    keys = {node_id: i for i, node_id in enumerate(node_ids)}
    store = Store(sqlite_url(workdir / "coordinator"))
    try:
        deadline = time.monotonic() + deadline_s
        while store.pending_claims() and time.monotonic() < deadline:
            time.sleep(0.5)
        return {keys[k]: (c.samples, c.flops) for k, c in store.credits_by_peer().items() if k in keys}
    finally:
        store.close()


def _show_progress(peers: list[Any], rounds: int) -> None:
    shown = 0
    while any(peer.proc.poll() is None for peer in peers):
        latest = [peer.rounds()[-1] for peer in peers if peer.rounds()]
        done = min((r["round"] for r in latest), default=0) if len(latest) == len(peers) else 0
        if done > shown:
            shown = done
            rows = [row for peer in peers for row in peer.rounds() if row["round"] == done]
            losses = [r["loss"] for r in rows if math.isfinite(r["loss"])]
            loss = sum(losses) / len(losses) if losses else math.nan
            agree = len({r["state_digest"] for r in rows}) == 1
            bar = "#" * (20 * done // rounds)
            print(
                f"[{bar:<20}] round {done}/{rounds} | loss {loss:.3f} | group {rows[0]['group_size']} | "
                f"digests {'agree' if agree else 'DIFFER'}",
                flush=True,
            )
        time.sleep(0.2)


def summarize(histories: list[list[dict[str, Any]]], exit_codes: list[int]) -> dict[str, Any]:
    """The demo's outcome from each peer's metrics rows, compared by global round number.

    A peer that failed a round and re-synced skips that number; a row whose peer found
    itself out of sync with its group (``in_sync`` false: it started that round from another
    state, and re-syncs from a peer if one is still there) is counted apart, not compared."""
    by_round: dict[int, set[str]] = {}
    out_of_sync = 0
    for history in histories:
        for row in history:
            if row["averaged"] and row.get("in_sync", True):
                by_round.setdefault(row["round"], set()).add(row["state_digest"])
            elif row["averaged"]:
                out_of_sync += 1
    agreeing = sum(1 for digests in by_round.values() if len(digests) == 1)
    # a round a peer joined with no steps (or whose work it dropped) measured no loss (NaN)
    trained = [[r for r in h if math.isfinite(r["loss"])] for h in histories]
    first = [h[0]["loss"] for h in trained if h]
    last = [h[-1]["loss"] for h in trained if h]
    loss_first = sum(first) / len(first) if first else float("nan")
    loss_last = sum(last) / len(last) if last else float("nan")
    peers = [
        {
            "peer": i,
            "rounds": len(h),
            "samples": sum(r["samples"] for r in h),
            "bytes_sent": sum(r["bytes_sent"] for r in h),
            "final_round": h[-1]["round"] if h else 0,
            "exit_code": code,
        }
        for i, (h, code) in enumerate(zip(histories, exit_codes))
    ]
    rounds = len(by_round)
    ok = rounds > 0 and all(c == 0 for c in exit_codes) and loss_last < loss_first and agreeing == rounds
    return {
        "rounds": rounds,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "rounds_with_identical_digests": agreeing,
        "digests_agree": agreeing == rounds,
        "out_of_sync_rows": out_of_sync,
        "final_digest": histories[0][-1]["state_digest"] if histories and histories[0] else None,
        "peers": peers,
        "ok": ok,
    }


def _print_summary(summary: dict[str, Any]) -> None:
    print("\ndemo summary")
    print(f"  rounds:          {summary['rounds']}")
    print(f"  loss:            {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}")
    print(
        f"  digests agree:   {'yes' if summary['digests_agree'] else 'NO'} "
        f"({summary['rounds_with_identical_digests']}/{summary['rounds']} rounds bit-identical)"
    )
    if summary["out_of_sync_rows"]:
        print(
            f"  out of sync:     {summary['out_of_sync_rows']} peer-round(s) flagged by the peer itself (it re-syncs)"
        )
    for peer in summary["peers"]:
        print(
            f"  peer {peer['peer']}: {peer['rounds']} rounds, {peer['samples']} samples, "
            f"{peer['bytes_sent'] / 1e6:.2f} MB sent, credited {peer.get('credited_samples', 0)} samples "
            f"({peer.get('credited_flops', 0.0):.2e} FLOPs), exit {peer['exit_code']}"
        )
    print(f"demo {'succeeded' if summary['ok'] else 'FAILED'}")
