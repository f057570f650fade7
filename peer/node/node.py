"""A node of several local ranks that is one member of the swarm (issue #13).

``swarmtrain peer --nproc-per-node N`` (or ``torchrun``) runs N processes in one
``torch.distributed`` process group (NCCL on CUDA, gloo on CPU). They split the inner phase
data-parallel: each rank trains on its own part of the node's data, and
``DistributedDataParallel`` averages the gradients in backward, so every rank steps on the
same gradient and holds the same model. Rank 0, the **leader**, is the node's swarm member:
it runs the ``Trainer`` (θ_g, outer momentum, averager, digests, checkpoints, coordinator
link) exactly as a one-rank peer does, and drives the others. The other ranks run
``run_worker``: a loop over the leader's commands.

- ``STEP r s d``: inner step ``s`` of round ``r`` (the learning rate) reading data round
  ``d`` (positional data; every rank its own stream's batch);
- ``SYNC g``: the leader's model goes to every rank (with DDP also its inner-optimizer state;
  with FSDP2 each rank takes its shard of it). The leader sends it before the first step
  after anything but a step touched its model (a round landed and re-based the model, a
  re-sync adopted a state, a non-finite model was dropped, a checkpoint was restored), so
  the ranks never drift from the leader; ``g`` counts the leader's inner-optimizer rebuilds,
  and a rank seeing a new one rebuilds its own;
- ``GATHER`` (FSDP2 only): every rank's shards, whole, into the leader's plain copy, before
  the leader's host work reads it;
- ``STOP``: leave.

A node's weight in swarm averaging is the samples of all its ranks. If a rank dies, the
collectives of the others fail (gloo/NCCL see the connection go); if it stops or freezes,
its heartbeat does; either way the launcher (``swarmtrain.node_launcher``) stops the node
and names the rank.
"""

from __future__ import annotations

import copy
import datetime
import enum
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peer.node.inner_step import Precision, inner_optimizer, inner_step
from peer.node.node_env import HEARTBEAT_ENV, NodeEnv
from peer.task import Task
from peer.task.base import derive_seed
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 2.0
DEFAULT_TIMEOUT_S = 1800.0
"""How long a rank waits in a collective (for a command, a step) before the node gives up:
a leader averaging without overlap sends no command for a whole all-reduce."""


def rank_shard_seed(node_seed: int, rank: int) -> int:
    """The data shard seed of local rank ``rank``: the node's own for the leader (a one-rank
    node trains on what it always did), one derived from it for the others."""
    return node_seed if rank == 0 else derive_seed(node_seed, "local-rank", rank)


class Command(enum.IntEnum):
    STEP = 1
    SYNC = 2
    STOP = 3
    GATHER = 4


class LocalNode:
    """This process's place in the node's process group, and the collectives the node uses."""

    def __init__(self, env: NodeEnv, *, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank = env.rank
        self.world_size = env.world_size
        self.device = device
        self.sharded = False
        """Whether the replicas are FSDP2 shards (``wrap(..., shard=True)``) rather than DDP copies."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend,
            init_method="env://",  # under torchrun: its agent's store
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self._command = torch.zeros(4, dtype=torch.int64, device=device)
        beat = os.environ.get(HEARTBEAT_ENV)
        if beat:
            threading.Thread(target=_heartbeat, args=(Path(beat),), name="rank-heartbeat", daemon=True).start()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank (small objects: the spec, the node's seed)."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=torch.device(self.device))
        return box[0]

    def wrap(self, model: torch.nn.Module, *, shard: bool = False) -> torch.nn.Module:
        """What this rank trains. Without ``shard``: ``model`` itself behind
        ``DistributedDataParallel`` (its backward averages gradients across the node; it also
        broadcasts the leader's parameters once, here). With ``shard``: an FSDP2 copy of
        ``model`` (``fully_shard`` on every block of its ``ModuleList``s, then the root), each rank
        holding a 1/N shard of the parameters, gradients and optimizer state; ``model`` stays a
        plain full copy that ``gather``/``scatter`` exchange with the shards."""
        if not shard:
            from torch.nn.parallel import DistributedDataParallel

            ids = [torch.device(self.device).index] if self.device.startswith("cuda") else None
            return DistributedDataParallel(model, device_ids=ids)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.sharded = True
        replica = copy.deepcopy(model)
        mesh = init_device_mesh(torch.device(self.device).type, (self.world_size,))
        for module in list(replica.modules()):
            if isinstance(module, torch.nn.ModuleList):
                for block in module:
                    fully_shard(block, mesh=mesh)
        fully_shard(replica, mesh=mesh)
        replica.to(self.device)
        self.scatter(model, replica)  # every rank starts from the leader's parameters
        return replica

    @torch.no_grad()
    def gather(self, replica: torch.nn.Module, model: torch.nn.Module) -> None:
        """Every rank: the shards' parameters, whole, into the leader's ``model`` (one
        parameter at a time: one full parameter of temporary memory)."""
        for full, shard in zip(model.parameters(), replica.parameters(), strict=True):
            whole = shard.full_tensor()  # type: ignore[attr-defined]
            if self.is_leader:
                full.data.copy_(whole)

    @torch.no_grad()
    def scatter(self, model: torch.nn.Module, replica: torch.nn.Module) -> None:
        """Every rank: the leader's ``model`` parameters into each rank's shard (the others'
        ``model`` only lends its shapes)."""
        from torch.distributed.tensor import distribute_tensor

        for full, shard in zip(model.parameters(), replica.parameters(), strict=True):
            source = full.data.to(self.device)
            sharded = distribute_tensor(source, shard.device_mesh, shard.placements, src_data_rank=0)  # type: ignore[attr-defined]
            shard.to_local().copy_(sharded.to_local())  # type: ignore[attr-defined]

    def send(self, command: Command, *arguments: int) -> None:
        """Leader: tell every other rank what to do next (a command and up to three integers)."""
        values = [int(command), *arguments, 0, 0, 0][:4]
        for i, value in enumerate(values):
            self._command[i] = int(value)
        dist.broadcast(self._command, src=0)

    def receive(self) -> tuple[Command, int, int, int]:
        """Other ranks: the leader's next command and its three integers."""
        dist.broadcast(self._command, src=0)
        values = [int(v) for v in self._command.tolist()]
        return Command(values[0]), values[1], values[2], values[3]

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, replica: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank: the leader's ``model`` into every replica. Sharded, into each rank's shard
        (the optimizer state stays sharded: each rank keeps its own); otherwise the leader's
        parameters and inner-optimizer state, in place."""
        if self.sharded:
            self.scatter(model, replica)
            return
        params = list(model.parameters())
        for param in params:
            self._broadcast(param.data)
        layout = None
        if self.is_leader:
            layout = [
                [
                    (key, (tuple(value.shape), str(value.dtype).removeprefix("torch."), str(value.device)), None)
                    if torch.is_tensor(value)
                    else (key, None, value)
                    for key, value in (sorted(optimizer.state[p].items()) if p in optimizer.state else [])
                ]
                for p in params
            ]
        layout = self.share(layout)
        for param, entries in zip(params, layout, strict=True):
            state = optimizer.state[param]
            if not self.is_leader:
                for key in set(state) - {key for key, *_ in entries}:
                    del state[key]
            for key, tensor, value in entries:
                if tensor is None:
                    state[key] = value
                    continue
                shape, dtype, on = tensor
                current = state.get(key)
                if not self.is_leader and (current is None or tuple(current.shape) != shape):
                    current = state[key] = torch.empty(shape, dtype=getattr(torch, dtype), device=on)
                self._broadcast(current)
            if not entries and param in optimizer.state:
                del optimizer.state[param]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast from the leader; via the node's device for a CPU tensor under NCCL (AdamW
        keeps its step count on the CPU)."""
        if tensor.device == torch.device(self.device) or not self.device.startswith("cuda"):
            dist.broadcast(tensor, src=0)
            return
        staged = tensor.to(self.device)
        dist.broadcast(staged, src=0)
        tensor.copy_(staged)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the node's ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _heartbeat(path: Path) -> None:
    """Touch ``path`` every ``HEARTBEAT_EVERY_S`` while this process runs (and is not stopped)."""
    while True:
        try:
            path.touch()
        except OSError as exc:
            logger.warning("local rank heartbeat %s: %s", path, exc)
        time.sleep(HEARTBEAT_EVERY_S)


def run_worker(node: LocalNode, spec: RunSpec, task: Task, *, shard: bool = False) -> None:
    """A rank other than the leader: follow the leader's commands until ``STOP``. ``SYNC n``
    carries the leader's optimizer generation: a new one means it rebuilt its inner optimizer
    (a dropped non-finite model), and so does this rank."""
    model = task.model if shard else task.model.to(node.device)
    forward = node.wrap(model, shard=shard)
    optimizer = inner_optimizer(spec, forward)
    precision = Precision.for_device(node.device)
    generation = 0
    steps = 0
    while True:
        command, argument, second, third = node.receive()
        if command is Command.STOP:
            logger.info("local rank %d: %d inner steps, stopping", node.rank, steps)
            return
        if command is Command.SYNC:
            if argument != generation:
                optimizer, generation = inner_optimizer(spec, forward), argument
            node.sync(model, forward, optimizer)
        elif command is Command.GATHER:
            node.gather(forward, model)
        elif command is Command.STEP:
            loss = inner_step(
                forward, optimizer, task, spec, round_=argument, step=second, data_round=third, precision=precision
            )
            node.mean(loss)
            steps += 1
