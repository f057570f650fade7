"""A baseline peer: the same task as swarmtrain's, trained with hivemind.Optimizer.

    python -m benchmarks.baseline_hivemind --spec SPEC --mode sync|local --peers N \\
        --host IP [--initial-peers MADDR...] --rounds R --metrics-file F

``sync``: hivemind's standard collaborative mode as its documentation shows it, with the
global batch = one local batch per peer, so gradients are averaged at every step
(synchronous data parallel over the swarm). ``local``: ``use_local_updates=True`` (local
SGD as hivemind ships it): every peer steps on its own batches and parameters are averaged
each time the swarm has processed N·H batches, H = the spec's inner steps (the same
averaging period as a swarmtrain round).

Rows of ``--metrics-file`` follow swarmtrain's keys so ``benchmarks.wan_figures`` reads
both: one row per H local steps ("a round": the same samples as a swarmtrain round), with
compute_s (forward + backward), wall_s, samples, loss, params; bytes are measured on the
simulated link by the caller.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from functools import partial
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baseline_hivemind")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--mode", choices=["sync", "local"], required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--shard-seed", type=int, default=0)
    parser.add_argument("--metrics-file", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import hivemind

    from peer.task import build_task
    from protocol.spec import load_spec

    spec = load_spec(args.spec)
    task = build_task(spec, shard_seed=args.shard_seed)
    batch, steps = task.samples_per_batch, spec.rounds.inner_steps or 1
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    for maddr in dht.get_visible_maddrs():
        print(f"listening: {maddr}", flush=True)
    target = args.peers * batch * (steps if args.mode == "local" else 1)
    inner = spec.inner
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=f"baseline-{args.mode}-{spec.digest()[7:19]}",
        target_batch_size=target,
        batch_size_per_step=batch,
        params=task.model.parameters(),
        optimizer=partial(torch.optim.AdamW, lr=inner.lr, betas=tuple(inner.betas), weight_decay=inner.weight_decay),
        use_local_updates=args.mode == "local",
        matchmaking_time=3.0,
        averaging_timeout=120.0,
        verbose=False,
    )
    params = sum(p.numel() for p in task.model.parameters())
    _barrier(dht, f"baseline-{args.mode}-barrier", args.peers)  # start together, like swarmtrain's group wait
    opt.load_state_from_peers()
    with args.metrics_file.open("w") as out:
        for round_ in range(args.rounds):
            started, compute, losses, epoch_before = time.monotonic(), 0.0, [], opt.local_epoch
            for _ in range(steps):
                t0 = time.monotonic()
                loss = task.loss_fn(task.model, next(task.batches))
                opt.zero_grad()
                loss.backward()
                compute += time.monotonic() - t0
                losses.append(float(loss.detach()))
                opt.step()
            row = {
                "round": round_ + 1,
                "samples": batch * steps,
                "loss": sum(losses) / len(losses),
                "compute_s": round(compute, 4),
                "wall_s": round(time.monotonic() - started, 4),
                "averaged": opt.local_epoch > epoch_before,
                "epoch": opt.local_epoch,
                "params": params,
                "bytes_sent": 0,
                "allreduce_s": 0.0,
            }
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"round {round_ + 1}: loss {row['loss']:.4f}, epoch {opt.local_epoch}", flush=True)
    opt.shutdown()
    dht.shutdown()
    return 0


def _barrier(dht: object, key: str, peers: int, deadline_s: float = 300.0) -> None:
    """Wait until ``peers`` processes announced themselves under ``key`` in the DHT."""
    from hivemind.utils.timed_storage import get_dht_time

    me = str(dht.peer_id)  # type: ignore[attr-defined]
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        dht.store(key, subkey=me, value=True, expiration_time=get_dht_time() + deadline_s)  # type: ignore[attr-defined]
        found = dht.get(key, latest=True)  # type: ignore[attr-defined]
        if found is not None and isinstance(found.value, dict) and len(found.value) >= peers:
            return
        time.sleep(1.0)
    raise SystemExit(f"only some of {peers} baseline peers showed up within {deadline_s:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
