"""Round figures into the experiment trackers people already use: TensorBoard and W&B.

``--log-to tensorboard:DIR`` (peer and coordinator) writes TensorBoard event files with
tensorboard's own writer (no torch or TensorFlow needed, so the coordinator can too);
``--log-to wandb:PROJECT`` logs to Weights & Biases, offline unless ``WANDB_MODE`` says
otherwise or an API key is set (``wandb sync`` uploads later). Several targets may be given.
Shared by both roles, so it lives here; it touches nothing on the wire.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from protocol.errors import ConfigError

logger = logging.getLogger(__name__)

KINDS = ("tensorboard", "wandb")
WandbMode = Literal["online", "offline", "disabled", "shared"]
WANDB_MODES: dict[str, WandbMode] = {
    "online": "online",
    "offline": "offline",
    "disabled": "disabled",
    "shared": "shared",
}


class _Sink(Protocol):
    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def parse_target(text: str) -> tuple[str, str]:
    """``KIND:WHERE`` of a ``--log-to`` value; ConfigError naming what is wrong."""
    kind, sep, where = text.partition(":")
    if not sep or kind not in KINDS or not where:
        raise ConfigError(f"--log-to {text!r}: expected tensorboard:DIR or wandb:PROJECT")
    return kind, where


class TensorBoardSink:
    """Scalars as TensorBoard events under ``directory`` (one event file per process)."""

    def __init__(self, directory: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--log-to tensorboard:{directory}: cannot create it ({exc.strerror or exc})") from exc
        self._writer = EventFileWriter(str(path))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars to a W&B run of ``project`` (offline by default: no network needed)."""

    def __init__(self, project: str, *, name: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("--log-to wandb:... needs the wandb package: pip install wandb") from exc
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        chosen = WANDB_MODES.get(mode)
        if chosen is None:
            raise ConfigError(f"--log-to wandb:{project}: WANDB_MODE={mode!r} is not one of {', '.join(WANDB_MODES)}")
        self._run = wandb.init(project=project, name=name, mode=chosen, reinit=True)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class ExperimentLog:
    """Every ``--log-to`` target of this process; ``scalars`` goes to each (finite values only)."""

    def __init__(self, targets: Iterable[str], *, name: str) -> None:
        self._sinks: list[_Sink] = []
        for text in targets:
            kind, where = parse_target(text)
            self._sinks.append(TensorBoardSink(where) if kind == "tensorboard" else WandbSink(where, name=name))

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log the finite numbers of ``values`` at ``step`` (a failing tracker is logged, never raised:
        training does not stop for it)."""
        finite = {
            tag: float(value)
            for tag, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        for sink in self._sinks:
            try:
                sink.scalars(step, finite)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop a round
                logger.warning("experiment log %s failed: %s", type(sink).__name__, exc)

    def close(self) -> None:
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("closing experiment log %s: %s", type(sink).__name__, exc)


PEER_FIGURES = (
    "loss",
    "val_loss",
    "samples",
    "group_size",
    "compute_s",
    "wait_s",
    "allreduce_s",
    "host_s",
    "bytes_sent",
    "bytes_received",
    "lr",
    "unaveraged",
)
"""A peer's round metrics (``peer.round.round_metrics``) logged per round."""


def peer_figures(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one peer round row worth charting, plus samples/s."""
    out = {f"peer/{key}": metrics.get(key) for key in PEER_FIGURES}
    wall = metrics.get("wall_s") or 0
    if wall:
        out["peer/samples_per_s"] = metrics.get("samples", 0) / wall
    return out
