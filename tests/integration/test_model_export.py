"""The coordinator's model export (``coordinator.exporter``): each newer archived round becomes a
transformers model directory through a real ``swarmtrain export`` child, only the newest is kept,
only its listed files are served, a failed export is said once and not retried for that round,
and a restarted coordinator finds the export it made."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from coordinator.archive import CheckpointArchive
from coordinator.exporter import ModelExporter
from peer.round.state import flatten
from peer.task.bytegpt import build_model
from protocol.spec import parse_spec

SPEC = parse_spec("[run]\nname='exported'\n[task.model]\nd_model=32\nn_layers=1\nn_heads=2\ncontext=32\n")


def archived(archive: CheckpointArchive, round_: int) -> torch.Tensor:
    params = flatten(build_model(SPEC.task.model, seed=round_))
    archive.save(round_, params, torch.zeros_like(params), now=float(round_))
    return params


def test_each_newer_archived_round_is_exported_and_only_its_files_are_served(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    archive = CheckpointArchive(tmp_path / "archive", spec_digest=SPEC.digest(), keep=2, spec=SPEC)
    exporter = ModelExporter(archive, tmp_path / "export")
    exporter.poll()
    assert exporter.latest() is None  # nothing archived yet
    archived(archive, 10)
    exporter.poll()
    first = exporter.latest()
    assert first is not None and first.round == 10 and first.architecture == "gpt2", exporter.last_error
    assert {"config.json", "model.safetensors", "tokenizer.json", "swarmtrain.json"} <= {f.name for f in first.files}
    assert exporter.file("model.safetensors") == first.directory / "model.safetensors"
    for name in ("../archive/index.json", "index.json", "", "swarmtrain.json/.."):
        assert exporter.file(name) is None
    params = archived(archive, 20)
    exporter.poll()
    second = exporter.latest()
    assert second is not None and second.round == 20
    assert not first.directory.exists()  # only the newest is kept
    model = AutoModelForCausalLM.from_pretrained(str(second.directory))
    assert sum(p.numel() for p in model.parameters()) == params.numel() == second.parameters

    # a newer round whose checkpoint is damaged: the export fails, is said, and not retried
    archived(archive, 30)
    newest = archive.directory / archive.list()[0].file
    newest.write_bytes(newest.read_bytes()[:100])
    exporter.poll()
    assert exporter.latest() == second and "not a readable checkpoint" in exporter.last_error, exporter.last_error
    error = exporter.last_error
    exporter.last_error = ""
    exporter.poll()
    assert exporter.last_error == ""  # the same round is not tried again
    assert error

    # a restarted coordinator serves the export it made
    again = ModelExporter(archive, tmp_path / "export")
    assert again.latest() is not None and again.latest().round == 20  # type: ignore[union-attr]
    assert json.loads((second.directory / "swarmtrain.json").read_text())["round"] == 20
