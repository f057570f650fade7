"""Where this process sits in a node of several local ranks (issue #13): torchrun's
environment variables, read without importing torch, so that ``swarmtrain`` decides whether
to launch ranks (``swarmtrain.node_launcher``) before any heavy import; ``peer.node.node`` holds
the process group itself."""

from __future__ import annotations

import dataclasses
import os

from protocol.errors import ConfigError

HEARTBEAT_ENV = "SWARMTRAIN_RANK_HEARTBEAT"
"""A file each rank touches every ``peer.node.node.HEARTBEAT_EVERY_S`` (set by ``swarmtrain.node_launcher``,
which declares a rank hung when it stops)."""


@dataclasses.dataclass(frozen=True)
class NodeEnv:
    """Where this process sits in its node: torchrun's environment variables."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> NodeEnv | None:
        """The node this process belongs to, or None outside one (no ``WORLD_SIZE``). A world of
        one is a node of one rank (``--nproc-per-node 1``, ``torchrun --nproc-per-node 1``)."""
        env = dict(os.environ if environ is None else environ)
        if "WORLD_SIZE" not in env:
            return None
        try:
            world = int(env["WORLD_SIZE"])
            rank = int(env.get("LOCAL_RANK", env.get("RANK", "0")))
            port = int(env.get("MASTER_PORT", "0"))
        except ValueError as exc:
            raise ConfigError(f"bad torch.distributed environment: {exc}") from None
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"bad torch.distributed environment: rank {rank} of world size {world}")
        if int(env.get("NNODES", env.get("GROUP_WORLD_SIZE", "1"))) != 1 or env.get(
            "LOCAL_WORLD_SIZE", str(world)
        ) != str(world):
            raise ConfigError("a swarmtrain node is one machine: run torchrun with --nnodes 1")
        if not 0 < port < 65536:
            raise ConfigError(f"bad torch.distributed environment: MASTER_PORT {port}")
        return cls(rank, world, env.get("MASTER_ADDR", "127.0.0.1"), port)
