"""A node's local rank other than the leader: it trains what the leader tells it
(``peer.node.node``); the leader alone talks to the swarm and the coordinator. Imports torch
and the node, never the swarm, hivemind or the coordinator's client."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch

from peer.boot.compute import local_compute_spec
from peer.node.node import LocalNode, rank_shard_seed, run_worker
from peer.task import build_task
from protocol.spec import parse_spec


def device_of(requested: str | None, node_env: Any) -> str:
    """The torch device of this process: ``--device``, else CUDA if there is one; with several
    local ranks on CUDA, rank r takes GPU r."""
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if node_env is not None and device == "cuda":
        return f"cuda:{node_env.rank}"
    return device


def data_cap_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * 1e9)


def run_worker_rank(args: argparse.Namespace, node_env: Any) -> int:
    """A local rank other than the leader: it trains what the leader tells it (``peer.node.node``);
    the leader alone talks to the swarm and the coordinator."""
    local_node = LocalNode(node_env, device=device_of(args.device, node_env))
    try:
        shared = local_node.share(None)
        spec = parse_spec(shared["spec"], source="the spec of this node's leader")
        args.micro_batches = shared.get("micro_batches")
        args.activation_checkpointing = shared.get("activation_checkpointing")
        args.compile = shared.get("compile")
        spec = local_compute_spec(spec, args)  # the leader's choice (checked there)
        seed = rank_shard_seed(int(shared["seed"]), node_env.rank)
        shard = bool(shared["shard"])
        # a node holds consecutive data streams, one per rank
        slot = None if shared["slot"] is None else int(shared["slot"]) + node_env.rank
        device = "cpu" if shard else local_node.device
        task = build_task(
            spec,
            shard_seed=seed,
            device=device,
            slot=slot,
            data_dir=shared["data_dir"],
            weights_dir=shared["weights_dir"],
            data_cap_bytes=data_cap_bytes(None if shared.get("data_cap") is None else float(shared["data_cap"])),
        )
        run_worker(local_node, spec, task, shard=shard)
    finally:
        local_node.close()
    # done, cleanly: leave without the interpreter's finalization, which destroys what gloo's
    # worker threads may still hold (FSDP2's async work) and then aborts the process now and
    # then ("terminate called without an active exception": a rank killed by SIGABRT after
    # a clean stop). This rank writes no files; its output is flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
