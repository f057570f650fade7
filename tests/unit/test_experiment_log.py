"""``--log-to``: TensorBoard events read back by tensorboard's own reader; bad targets refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from protocol.errors import ConfigError
from protocol.experiment_log import ExperimentLog, parse_target, peer_figures


def test_tensorboard_scalars_round_trip_and_non_numbers_are_left_out(tmp_path: Path) -> None:
    log = ExperimentLog([f"tensorboard:{tmp_path / 'tb'}"], name="t")
    for round_ in range(3):
        row = {"loss": 3.0 - round_, "val_loss": None if round_ == 0 else 2.5, "samples": 8, "wall_s": 2.0}
        log.scalars(round_, {**peer_figures(row), "peer/nan": math.nan, "peer/flag": True})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("peer/loss")] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert [e.step for e in events.Scalars("peer/val_loss")] == [1, 2]
    assert [e.value for e in events.Scalars("peer/samples_per_s")] == [4.0, 4.0, 4.0]
    assert "peer/nan" not in events.Tags()["scalars"] and "peer/flag" not in events.Tags()["scalars"]


def test_bad_targets_are_refused_with_the_fix() -> None:
    for bad in ("tensorboard", "tensorboard:", "csv:out", ":dir"):
        with pytest.raises(ConfigError, match="expected tensorboard:DIR or wandb:PROJECT"):
            parse_target(bad)
    assert parse_target("wandb:my-run") == ("wandb", "my-run")
    try:
        import wandb  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install wandb"):
            ExperimentLog(["wandb:project"], name="t")
