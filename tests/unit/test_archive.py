"""The coordinator's checkpoint archive on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.archive import CheckpointArchive
from protocol.errors import ConfigError


def test_archive_skips_a_corrupted_newest_checkpoint(tmp_path: Path) -> None:
    archive = CheckpointArchive(tmp_path, spec_digest="sha256:run", keep=3)
    params, momentum = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    archive.save(2, params, momentum, now=1.0)
    newest = archive.save(4, params + 1, momentum, now=2.0)
    assert [e.round for e in archive.list()] == [4, 2]
    path = tmp_path / newest.file
    path.write_bytes(path.read_bytes()[:-100])  # torn
    loaded = archive.load_latest()
    assert loaded is not None and loaded.round == 2 and torch.equal(loaded.params, params)


def test_archive_keeps_the_newest_and_lists_without_tensors(tmp_path: Path) -> None:
    archive = CheckpointArchive(tmp_path, spec_digest="sha256:run", keep=2)
    for round_ in (1, 3, 5):
        archive.save(round_, torch.full((4,), float(round_)), torch.zeros(4), now=float(round_))
    assert [e.round for e in archive.list()] == [5, 3]
    assert sorted(p.name for p in tmp_path.glob("round-*.pt")) == sorted(e.file for e in archive.list())
    (tmp_path / "index.json").write_text("{not json")
    assert archive.list() == []  # an unreadable index lists nothing; the files still load
    assert archive.load_latest().round == 5  # type: ignore[union-attr]


def test_archive_of_another_run_is_not_served(tmp_path: Path) -> None:
    CheckpointArchive(tmp_path, spec_digest="sha256:one", keep=2).save(3, torch.zeros(4), torch.zeros(4), now=1.0)
    assert CheckpointArchive(tmp_path, spec_digest="sha256:two", keep=2).load_latest() is None
    with pytest.raises(ConfigError):
        CheckpointArchive(tmp_path, spec_digest="sha256:one", keep=0)


def test_an_older_round_saved_late_keeps_the_listing_true_to_the_disk(tmp_path: Path) -> None:
    """After a restart the archive may save a round older than one it holds: the listing and
    the files kept agree (the newest rounds), never naming a file that was pruned."""
    archive = CheckpointArchive(tmp_path, spec_digest="sha256:run", keep=2)
    for round_ in (5, 3, 1):
        archive.save(round_, torch.full((4,), float(round_)), torch.zeros(4), now=float(round_))
    assert [e.round for e in archive.list()] == [5, 3]
    assert sorted(p.name for p in tmp_path.glob("round-*.pt")) == sorted(e.file for e in archive.list())
