"""A peer's start, second half: where and over which local ranks it trains, its task, and its
swarm (DHT node and averager); a node's other local ranks run ``run_worker_rank``."""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bulk_settings import BulkSettings
from engine.codecs import get_codec
from engine.update_store import UpdateStore
from peer.boot.join import Joined, until_stopped
from peer.boot.worker import data_cap_bytes, device_of
from peer.net.announce import mapped_port
from peer.net.network_path import NetworkPath
from peer.node.node import LocalNode
from peer.node.node_env import NodeEnv
from peer.node.node_identity import NodeIdentity
from peer.swarm.swarm import Swarm
from peer.task import Task, build_task, known_param_count
from protocol.identity import Identity
from protocol.membership import MemberGate
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


BOOTSTRAP_WAIT_S = 600.0
"""How long a peer keeps starting its DHT node while none of its bootstrap peers answers (a
coordinator restarting between this peer's join and its DHT's start: ``engine.dht_start``)."""


@dataclass
class Plan:
    """How this node trains: on which device, over which local ranks, a model of what size."""

    device: str
    """This process's torch device."""
    local_node: LocalNode | None
    numel: int
    shard: bool
    """FSDP2 shards over the local ranks: the leader keeps a plain full copy of the model in
    host memory for the round's host passes, the ranks train shards of it on their devices."""
    shard_seed: int
    task: Task | None
    """Built already when the spec alone does not say the model's size."""

    @property
    def model_device(self) -> str:
        return "cpu" if self.shard else self.device


def bulk_settings(flag: str, host: str | None, env: Mapping[str, str]) -> BulkSettings:
    """``--bulk-port``'s settings; a fixed port that vast.ai's or RunPod's variables map is
    announced at its external port (as ``--port`` is, ``peer.net.announce``)."""
    bulk = BulkSettings.parse(flag, host=host)
    if bulk.enabled and bulk.port and not bulk.public_port:
        bulk.public_port = mapped_port(bulk.port, env) or 0
    return bulk


def plan_node(
    args: argparse.Namespace, joined: Joined, compute: RunSpec, node: NodeIdentity, node_env: NodeEnv | None
) -> Plan:
    """Where and over which local ranks this node trains. The model's size decides whether it
    shards (``use_fsdp``) and sizes the averager. hivemind's DHT and averager processes are
    forked from this one, so the model is built after them, or each would keep its first pages
    (copy-on-write) once training rewrites them: one more copy in host memory. Only a task whose
    size the spec does not say (``known_param_count``) is built first, to measure it. The other
    local ranks get what they need to build theirs (``LocalNode.share``)."""
    device = device_of(args.device, node_env)
    local_node = None
    if node_env is not None:
        local_node = LocalNode(node_env, device=device)
    shard_seed = args.shard_seed if args.shard_seed is not None else node.seed
    task: Task | None = None
    numel = known_param_count(joined.spec)
    shard = local_node is not None and use_fsdp(args.fsdp, numel, device)
    if numel is None:
        task = build_peer_task(args, joined, compute, shard_seed, "cpu" if shard else device)
        numel = sum(p.numel() for p in task.model.parameters())
        shard = local_node is not None and use_fsdp(args.fsdp, numel, device)
        if shard:
            task.model.to("cpu")
    if local_node is not None:
        spec_text = joined.info.spec_toml if joined.info is not None else args.spec.read_text()
        paths = {
            name: str(value) if value is not None else None
            for name, value in (("data_dir", args.data_dir), ("weights_dir", args.weights_dir))
        }
        paths["data_cap"] = None if args.data_cap is None else str(args.data_cap)
        local_node.share(
            {
                "spec": spec_text,
                "seed": shard_seed,
                "shard": shard,
                "slot": joined.slot,
                "micro_batches": args.micro_batches,
                "activation_checkpointing": args.activation_checkpointing,
                "compile": args.compile,
                **paths,
            }
        )
    return Plan(device, local_node, numel, shard, shard_seed, task)


TRAINING_BYTES_PER_PARAM = 16
"""fp32 parameters, gradients and AdamW's two moments."""


def use_fsdp(choice: str, numel: int | None, device: str) -> bool:
    """Whether a node of several ranks shards its model (``--fsdp``): ``on``/``off``, or ``auto``:
    on CUDA when the training state, with a quarter more for activations and buffers, exceeds
    one GPU's memory (unknown size: no); never on CPU."""
    if choice != "auto":
        return choice == "on"
    if numel is None or not device.startswith("cuda"):
        return False

    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return numel * TRAINING_BYTES_PER_PARAM * 1.25 > memory


def build_peer_task(args: argparse.Namespace, joined: Joined, compute: RunSpec, shard_seed: int, device: str) -> Task:

    return build_task(
        compute,
        shard_seed=shard_seed,
        device=device,
        slot=joined.slot,
        data_dir=args.data_dir,
        weights_dir=args.weights_dir,
        data_cap_bytes=data_cap_bytes(args.data_cap),
    )


def start_swarm(
    args: argparse.Namespace,
    joined: Joined,
    plan: Plan,
    path: NetworkPath,
    gate: MemberGate | None,
    identity: Identity,
    stop: threading.Event | None = None,
) -> Swarm:
    """This peer's DHT node and averager; in a coordinator's run only peers holding its tokens
    average with it (``gate``). With an announced address, the
    daemon advertises it instead of the addresses it sees locally, and takes itself as publicly
    reachable (libp2p's AutoNAT would otherwise drop a public address it could not confirm)."""
    ip = "0.0.0.0" if args.host in ("0.0.0.0", "") else args.host
    updates = None
    if not args.client_mode and args.keep_updates > 0:
        # (a checkpoint dir is one peer's: its lock; else a directory of this process's own)
        where = args.checkpoint_dir / "updates" if args.checkpoint_dir is not None else None
        updates = UpdateStore(where or Path(tempfile.mkdtemp(prefix="swarmtrain-updates-")), keep=args.keep_updates)
    return Swarm(
        joined.spec,
        plan.numel,
        get_codec(joined.spec.averaging.compression, joined.spec.averaging.density, joined.spec.averaging.bits),
        initial_peers=list(args.initial_peers),
        host_maddrs=[f"/ip4/{ip}/tcp/{args.port}"],
        client_mode=args.client_mode,
        gate=gate,
        dht_kwargs=path.dht_kwargs,
        updates=updates,
        identity=identity,
        bulk=bulk_settings(args.bulk_port, None if ip == "0.0.0.0" else ip, os.environ),
        bootstrap_wait_s=BOOTSTRAP_WAIT_S,
        bootstrap_pause=until_stopped(stop, "the swarm's bootstrap peers") if stop is not None else time.sleep,
    )
