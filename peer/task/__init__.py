"""The training task of a peer: model, data shard and loss, chosen by the run spec.

``build_task(spec, shard_seed=...)`` is the one entry point; ``Task`` is what it returns. They
load on first use: the package's light modules (``data_assignment``, which the round's metrics
row names) import without torch, so the CLI checks its arguments before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peer.task.base import Task
    from peer.task.registry import build_task, known_param_count

__all__ = ["Task", "build_task", "known_param_count"]
_HOME = {"Task": "peer.task.base", "build_task": "peer.task.registry", "known_param_count": "peer.task.registry"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'peer.task' has no attribute {name!r}")
