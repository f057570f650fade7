"""Prepared token shards (``swarmtrain data prepare``) read by a peer, and its batches.

The shards are memory-mapped: a peer reads only the rows its batches need, so a corpus of
any size costs page cache, not process memory. Which rows: ``peer.task.data_assignment``
(stream ``slot`` of the run trains page ``round x slots + slot``); this module reads them
and remembers which sequence ids each round read, for the round's report.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peer.task.base import Batch
from peer.task.data_assignment import DataAssignment, DataRead, ids_digest
from peer.task.fetch import DataFetcher, Prefetcher, parse_source
from protocol.errors import ConfigError
from protocol.manifest import Manifest, ShardEntry, load_manifest
from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


def data_directory(spec: RunSpec, data_dir: str | Path | None = None) -> Path:
    """Where this machine keeps the run's prepared data: ``data_dir`` if given, else the spec's
    ``data.path`` (if it is here or the run publishes no url), else a directory of this run's
    manifest under ``$SWARMTRAIN_HOME/data`` (default ``~/.cache/swarmtrain/data``)."""
    if data_dir is not None:
        return Path(data_dir)
    data = spec.data
    if data.path is not None and (data.url is None or Path(data.path).is_dir()):
        return Path(data.path)
    home = os.environ.get("SWARMTRAIN_HOME")
    root = Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarmtrain"
    return root / "data" / str(data.manifest).removeprefix("sha256:")[:16]


def open_data(
    spec: RunSpec, data_dir: str | Path | None = None, *, cap_bytes: int | None = None
) -> tuple[Path, Manifest, DataFetcher | None]:
    """The run's data, checked against the spec (``check_data``): a run that publishes its data
    (``data.url``) gets its manifest and tokenizer fetched here now and a ``DataFetcher`` for the
    shards, fetched as its pages need them (None: every shard must already be here)."""
    directory = data_directory(spec, data_dir)
    fetcher = None
    if spec.data.url is not None:
        assert spec.data.manifest is not None and spec.data.tokenizer is not None  # the spec enforces them
        fetcher = DataFetcher(parse_source(spec.data.url), directory, cap_bytes=cap_bytes)
        try:
            fetcher.manifest(spec.data.manifest)
            fetcher.tokenizer(spec.data.tokenizer)
        except BaseException:
            fetcher.close()
            raise
    _, manifest = check_data(spec, directory, require_shards=fetcher is None)
    return directory, manifest, fetcher


def check_data(
    spec: RunSpec, data_dir: str | Path | None = None, *, require_shards: bool = True
) -> tuple[Path, Manifest]:
    """The run's prepared data at ``data_dir`` (default: the spec's ``data.path``), checked
    against the spec: tokenizer, manifest digest, sequence length. Raises ``ConfigError``
    with one line naming the first mismatch."""
    data = spec.data
    lm = spec.task.causal_lm
    assert data.source == "tokens" and lm is not None  # the spec enforces both together
    directory = data_directory(spec, data_dir)
    manifest = load_manifest(directory, require_shards=require_shards)
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


def run_assignment(spec: RunSpec, manifest: Manifest) -> DataAssignment:
    """Who trains what in this run (``peer.task.data_assignment``), over the manifest's training shards."""
    assert spec.rounds.inner_steps is not None  # the spec enforces it for token runs
    return DataAssignment(
        sequences=manifest.train_sequences(),
        slots=spec.data.slots,
        steps=spec.rounds.inner_steps,
        batch=spec.inner.batch_size,
        seed=spec.data.seed,
        shards=tuple(entry.sequences for entry in manifest.train),
    )


class TokenShards:
    """One split's shards as one array of rows (``seq_len + 1`` tokens each), memory-mapped;
    with a ``fetcher``, each shard is fetched (verified) the first time a row of it is read."""

    def __init__(
        self, directory: Path, manifest: Manifest, entries: list[ShardEntry], *, fetcher: DataFetcher | None = None
    ) -> None:
        self.row = manifest.seq_len + 1
        self.directory, self.manifest, self.entries, self.fetcher = directory, manifest, entries, fetcher
        self._dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._maps: dict[int, np.memmap[Any, Any]] = {}
        self._starts = np.cumsum([0] + [entry.sequences for entry in entries])
        self.sequences = int(self._starts[-1])
        if fetcher is None:
            for shard in range(len(entries)):
                self._map(shard)
        else:
            fetcher.on_evict.append(self.forget)

    def _map(self, shard: int) -> np.memmap[Any, Any]:
        mapped = self._maps.get(shard)
        if mapped is None:
            entry = self.entries[shard]
            path = self.directory / entry.file
            if self.fetcher is not None:
                path = self.fetcher.shard(self.manifest, entry)
            mapped = np.memmap(path, dtype=self._dtype, mode="r", shape=(entry.sequences, self.row))
            self._maps[shard] = mapped
        return mapped

    def forget(self, name: str) -> None:
        """Drop the mapping of shard file ``name`` (removed from disk for room)."""
        for shard, entry in enumerate(self.entries):
            if entry.file == name:
                self._maps.pop(shard, None)

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Rows ``ids`` (sequence ids of this split) as an int64 (len(ids), seq_len + 1) tensor."""
        out = np.empty((len(ids), self.row), dtype=np.int64)
        for n, seq in enumerate(ids):
            if not 0 <= seq < self.sequences:
                raise IndexError(f"sequence {seq} is not in [0, {self.sequences})")
            shard = int(np.searchsorted(self._starts, seq, side="right")) - 1
            out[n] = self._map(shard)[seq - int(self._starts[shard])]
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
        self.prefetcher: Prefetcher | None = None
        if shards.fetcher is not None:
            self.prefetcher = Prefetcher(
                shards.fetcher, shards.manifest, lambda r: assignment.page_shards(r, slot) if r >= 0 else []
            )

    def batch_at(self, round_: int, step: int) -> Batch:
        if self.prefetcher is not None:
            self.prefetcher.round_starts(round_)
        ids = self.assignment.batch_ids(round_, self.slot, step)
        if round_ not in self._read:  # a new round: forget all but the one before (not reported yet)
            for old in [r for r in self._read if r < round_ - 1]:
                del self._read[old]
        self._read.setdefault(round_, []).extend(ids)
        return split_rows(self.shards.rows(ids))

    def report(self, round_: int) -> DataRead | None:
        """What round ``round_`` read (and forget it): the stream, the steps and the digest of
        the sequence ids in order (``peer.task.data_assignment.ids_digest``)."""
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
