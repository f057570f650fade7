"""``--log-to``: TensorBoard events read back by tensorboard's own reader, W&B's offline run
file read back record by record; bad targets refused."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from protocol.errors import ConfigError
from protocol.experiment_log import ExperimentLog, parse_target, peer_figures

ROOT = Path(__file__).resolve().parents[2]


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


def test_wandb_without_the_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does when it is absent
    with pytest.raises(ConfigError, match="pip install wandb"):
        ExperimentLog(["wandb:project"], name="t")


WANDB_PEER = """
from protocol.experiment_log import ExperimentLog
log = ExperimentLog(["wandb:swarm-test"], name="peer-1")
log.scalars(1, {"loss": 2.5, "samples": 100, "nan": float("nan")})
log.scalars(2, {"loss": 2.25, "samples": 200})
log.close()
"""


def test_wandb_logs_offline_with_no_network_at_all(tmp_path: Path) -> None:
    """A peer's figures go to an offline W&B run (no API key, no WANDB_MODE) in a process
    that has no network (its own network namespace, where this machine allows one); read
    back from the run's file (``wandb sync`` would upload it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WANDB_PEER]
    isolated = (
        shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    )
    done = subprocess.run(
        ["unshare", "-n", *command] if isolated else command, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = [row for kind, row in wandb_records(run_file) if kind == "history"]
    assert [(row["_step"], row["loss"], row["samples"]) for row in history] == [(1, 2.5, 100), (2, 2.25, 200)]
    assert all("nan" not in row for row in history)
    runs = [row for kind, row in wandb_records(run_file) if kind == "run"]
    assert runs and runs[0]["project"] == "swarm-test" and runs[0]["display_name"] == "peer-1"


def wandb_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The records of a ``.wandb`` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log blocks of 32 KiB holding chunks (crc32, length, type: full/first/middle/last)
    of serialized ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        block_left = 32768 - at % 32768
        if block_left < 7:  # a block's tail too short for a chunk header is padding
            at += block_left
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        chunk, at = data[at + 7 : at + 7 + length], at + 7 + length
        if kind == 0:  # zero padding
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            kind_name = record.WhichOneof("record_type")
            if kind_name == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                records.append(("history", row))
            elif kind_name == "run":
                records.append(("run", {"project": record.run.project, "display_name": record.run.display_name}))
    return records


def test_a_bad_wandb_mode_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="WANDB_MODE='sometimes' is not one of online, offline, disabled, shared"):
        ExperimentLog(["wandb:project"], name="t")
