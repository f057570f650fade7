"""Prepared token shards (``swarmtrain data prepare``) read by a peer, and its batches.

The shards are memory-mapped: a peer reads only the rows its batches need, so a corpus of
any size costs page cache, not process memory. Which rows: ``peer.data_assignment``
(stream ``slot`` of the run trains page ``round x slots + slot``); this module reads them
and remembers which sequence ids each round read, for the round's report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from peer.data_assignment import DataAssignment, DataRead, ids_digest
from peer.task.base import Batch
from protocol.errors import ConfigError
from protocol.manifest import Manifest, ShardEntry, load_manifest
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


def check_data(spec: RunSpec, data_dir: str | Path | None = None) -> tuple[Path, Manifest]:
    """The run's prepared data at ``data_dir`` (default: the spec's ``data.path``), checked
    against the spec: tokenizer, manifest digest, sequence length. Raises ``ConfigError``
    with one line naming the first mismatch."""
    data = spec.data
    lm = spec.task.causal_lm
    assert data.source == "tokens" and lm is not None  # the spec enforces both together
    directory = Path(data_dir if data_dir is not None else str(data.path))
    manifest = load_manifest(directory)
    if manifest.tokenizer_sha256 != data.tokenizer:
        raise ConfigError(
            f"tokenizer mismatch: the data in {directory} was prepared with tokenizer {manifest.tokenizer_sha256}, "
            f"the run uses {data.tokenizer}"
        )
    digest = manifest.digest()
    if digest != data.manifest:
        raise ConfigError(
            f"data manifest mismatch: the data in {directory} has manifest {digest}, the run uses {data.manifest} "
            "(prepare the run's inputs with `swarmtrain data prepare`, or point --data-dir at the run's data)"
        )
    if manifest.seq_len != lm.seq_len:
        raise ConfigError(f"the data in {directory} has sequences of {manifest.seq_len} tokens, the run {lm.seq_len}")
    vocab = lm.config.get("vocab_size", lm.config.get("n_vocab"))
    if isinstance(vocab, int) and manifest.vocab_size > vocab:
        raise ConfigError(f"the data's tokenizer has {manifest.vocab_size} tokens, the model's vocabulary {vocab}")
    return directory, manifest


class TokenShards:
    """One split's shards as one array of rows (``seq_len + 1`` tokens each), memory-mapped."""

    def __init__(self, directory: Path, manifest: Manifest, entries: list[ShardEntry]) -> None:
        self.row = manifest.seq_len + 1
        dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._maps = [
            np.memmap(directory / entry.file, dtype=dtype, mode="r", shape=(entry.sequences, self.row))
            for entry in entries
        ]
        self._starts = np.cumsum([0] + [entry.sequences for entry in entries])
        self.sequences = int(self._starts[-1])

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Rows ``ids`` (sequence ids of this split) as an int64 (len(ids), seq_len + 1) tensor."""
        out = np.empty((len(ids), self.row), dtype=np.int64)
        for n, seq in enumerate(ids):
            if not 0 <= seq < self.sequences:
                raise IndexError(f"sequence {seq} is not in [0, {self.sequences})")
            shard = int(np.searchsorted(self._starts, seq, side="right")) - 1
            out[n] = self._maps[shard][seq - int(self._starts[shard])]
        return torch.from_numpy(out)


def split_rows(rows: torch.Tensor) -> Batch:
    """(inputs, targets) of rows of ``seq_len + 1`` tokens."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class AssignedBatches:
    """The batches of data stream ``slot``: step ``step`` of round ``round_`` reads exactly
    ``assignment.batch_ids(round_, slot, step)``. Remembers what the last two rounds read
    (for ``report``; the other ranks of a node never report, and keep no more)."""

    def __init__(self, shards: TokenShards, assignment: DataAssignment, slot: int) -> None:
        if not 0 <= slot < assignment.slots:
            raise ConfigError(f"data stream {slot} is not one of the run's {assignment.slots} (data.slots)")
        self.shards, self.assignment, self.slot = shards, assignment, slot
        self._read: dict[int, list[int]] = {}

    def batch_at(self, round_: int, step: int) -> Batch:
        ids = self.assignment.batch_ids(round_, self.slot, step)
        if round_ not in self._read:  # a new round: forget all but the one before (not reported yet)
            for old in [r for r in self._read if r < round_ - 1]:
                del self._read[old]
        self._read.setdefault(round_, []).extend(ids)
        return split_rows(self.shards.rows(ids))

    def report(self, round_: int) -> DataRead | None:
        """What round ``round_`` read (and forget it): the stream, the steps and the digest of
        the sequence ids in order (``peer.data_assignment.ids_digest``)."""
        ids = self._read.pop(round_, None)
        for stale in [r for r in self._read if r < round_]:
            del self._read[stale]
        if ids is None:
            return None
        return DataRead(
            round=round_,
            slot=self.slot,
            steps=len(ids) // self.assignment.batch,
            ids_digest=ids_digest(ids),
            epoch=round(self.assignment.epoch(round_), 6),
        )


def eval_batches(shards: TokenShards, *, batch_size: int, n_batches: int) -> Iterator[Batch]:
    """The first ``n_batches`` batches of the validation split, the same on every peer and at
    every call (fewer if the split is smaller)."""
    total = min(shards.sequences, batch_size * n_batches)
    for start in range(0, total, batch_size):
        yield split_rows(shards.rows(list(range(start, min(total, start + batch_size)))))
