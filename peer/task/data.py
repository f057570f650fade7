"""Byte corpora and this peer's stream of training windows.

A corpus is a list of files read as bytes, in sorted order of their relative paths:
- ``stdlib``: the ``.py`` sources of this Python's standard library (no download; skips
  ``site-packages`` and ``test``/``tests`` directories; capped at ``max_bytes``). Note
  that its content depends on the Python version, so peers on different Pythons train
  and validate on slightly different text.
- ``dir``: every regular file under ``data.path`` (names starting with '.' skipped).

``validation_fraction`` of the files (chosen by ``data.seed``, the same on every peer)
is held out. Training files are concatenated (peer ``i`` of ``n`` keeps files ``i::n``)
and batches are random windows of ``context + 1`` bytes drawn with a generator seeded by
(``data.seed``, ``shard_seed``): other peers see other windows, and the same peer and
seeds see exactly the same ones.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from peer.task.base import Batch, derive_seed, generator
from protocol.errors import ConfigError
from protocol.spec import DataSection

logger = logging.getLogger(__name__)

STDLIB_MAX_BYTES = 16 * 1024 * 1024
"""Default cap on the stdlib corpus, in bytes (CPython 3.11's sources are ~12.6 MB)."""
EVAL_BATCHES = 8
"""Number of fixed held-out batches in a validation pass."""
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """This peer's training bytes and the run's held-out bytes, as 1-D uint8 tensors."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to its root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def dir_files(path: str) -> list[Path]:
    """Regular files under ``path``, recursively, sorted by relative path; ConfigError
    if ``path`` is not a directory or holds no files."""
    root = Path(path)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise ConfigError(f"data.path {path!r} {what}")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            file = Path(dirpath, name)
            if not name.startswith(".") and file.is_file():
                found.append((file.relative_to(root).as_posix(), file))
    if not found:
        raise ConfigError(f"data.path {path!r} holds no files")
    return [file for _, file in sorted(found)]


def read_files(paths: list[Path], *, max_bytes: int | None, skip_unreadable: bool) -> list[bytes]:
    """Contents of ``paths`` in order, stopping once ``max_bytes`` are read (the last
    file truncated). Unreadable files are skipped or raise ConfigError naming them."""
    contents: list[bytes] = []
    total = 0
    for path in paths:
        try:
            blob = path.read_bytes()
        except OSError as exc:
            if skip_unreadable:
                continue
            raise ConfigError(f"cannot read data file {str(path)!r}: {exc.strerror or exc}") from exc
        if max_bytes is not None and total + len(blob) >= max_bytes:
            contents.append(blob[: max_bytes - total])
            break
        contents.append(blob)
        total += len(blob)
    return [blob for blob in contents if blob]


def load_corpus(
    data: DataSection,
    *,
    context: int,
    num_shards: int = 1,
    shard_index: int = 0,
    max_bytes: int | None = None,
) -> Corpus:
    """Read the spec's corpus and keep this peer's training files and the held-out files.

    ``max_bytes`` caps what is read (default: ``STDLIB_MAX_BYTES`` for stdlib, no cap for
    dir). Raises ConfigError if the shard has fewer than ``context + 1`` bytes.
    """
    if not 0 <= shard_index < num_shards:
        raise ConfigError(f"shard_index {shard_index} is not in [0, num_shards={num_shards})")
    start = time.perf_counter()
    if data.source == "stdlib":
        where = "the Python standard library"
        cap = STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        blobs = read_files(stdlib_files(), max_bytes=cap, skip_unreadable=True)
    else:
        assert data.path is not None  # the spec enforces it
        where = f"data.path {data.path!r}"
        blobs = read_files(dir_files(data.path), max_bytes=max_bytes, skip_unreadable=False)
    val_ids = _held_out(len(blobs), data.validation_fraction, data.seed)
    train_blobs = [b for i, b in enumerate(blobs) if i not in val_ids][shard_index::num_shards]
    corpus = Corpus(
        train=_concat(train_blobs),
        val=_concat([blobs[i] for i in sorted(val_ids)]),
        train_files=len(train_blobs),
        val_files=len(val_ids),
    )
    if corpus.train.numel() < context + 1:
        shard = f" (shard {shard_index} of {num_shards})" if num_shards > 1 else ""
        raise ConfigError(
            f"{where} has {corpus.train.numel()} training bytes{shard}, "
            f"fewer than one sequence of context + 1 = {context + 1}"
        )
    logger.info(
        "corpus from %s: %d train bytes in %d files, %d held-out bytes in %d files, read in %.2f s",
        where,
        corpus.train.numel(),
        corpus.train_files,
        corpus.val.numel(),
        corpus.val_files,
        time.perf_counter() - start,
    )
    return corpus


def _held_out(n_files: int, fraction: float, seed: int) -> set[int]:
    """Indices of held-out files: round(fraction·n), at least 1 if fraction > 0, and
    always leaving one training file."""
    if fraction == 0 or n_files < 2:
        return set()
    k = min(max(1, round(fraction * n_files)), n_files - 1)
    perm = torch.randperm(n_files, generator=generator(derive_seed(seed, "validation-files")))
    return set(perm[:k].tolist())


def _concat(blobs: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray().join(blobs), dtype=torch.uint8) if blobs else torch.empty(0, dtype=torch.uint8)


def windows(data: torch.Tensor, *, context: int, batch_size: int, gen: torch.Generator) -> Batch:
    """One batch of random windows: inputs = window[:-1], targets = window[1:], int64."""
    starts = torch.randint(0, data.numel() - context, (batch_size,), generator=gen)
    window = data[starts[:, None] + torch.arange(context + 1)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_batches(
    data: torch.Tensor, *, context: int, batch_size: int, data_seed: int, shard_seed: int
) -> Iterator[Batch]:
    """Infinite stream of random windows of ``data`` seeded by (data_seed, shard_seed)."""
    assert data.numel() >= context + 1
    gen = generator(derive_seed(data_seed, "train", shard_seed))
    while True:
        yield windows(data, context=context, batch_size=batch_size, gen=gen)


def eval_batches(
    data: torch.Tensor, *, context: int, batch_size: int, data_seed: int, n_batches: int = EVAL_BATCHES
) -> Iterator[Batch]:
    """The same ``n_batches`` held-out batches at every call (and on every peer)."""
    gen = generator(derive_seed(data_seed, "eval"))
    for _ in range(n_batches):
        yield windows(data, context=context, batch_size=batch_size, gen=gen)
