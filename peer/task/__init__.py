"""The training task of a peer: model, data shard and loss, chosen by the run spec.

``build_task(spec, shard_seed=...)`` is the one entry point; ``Task`` is what it returns.
"""

from peer.task.base import Task
from peer.task.registry import build_task, known_param_count

__all__ = ["Task", "build_task", "known_param_count"]
