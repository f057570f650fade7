"""Offline preparation of token data: train a tokenizer, tokenize a corpus into shards.

``prepare`` turns text inputs into the directory that ``protocol.manifest`` describes:
documents are read in a fixed order, tokenized with the run's tokenizer (an EOS after each),
concatenated and cut into rows of ``seq_len + 1`` tokens. Whole documents are held out for
validation, chosen by a hash of (seed, document index), so the same inputs, tokenizer and
flags give the same bytes and the same manifest digest on any machine. Rows are written as
they fill, so memory stays bounded by one tokenization batch; then each split's rows are
shuffled across its shards by a seeded permutation (``row_order``: one pass over the split,
one shard in memory at a time), so that every shard is a random sample of the split (a peer
reads whole shards: ``peer.task.data_assignment``).

Inputs are files, or directories searched recursively (sorted; names starting with '.' and
``__pycache__`` skipped): ``.txt``/``.py``/``.md`` are one document per file (UTF-8);
``.jsonl``/``.json`` are one document per record and ``.parquet`` one per row, the text in
field ``text_field`` (read with HF ``datasets`` in streaming mode: nothing is cached on disk
and nothing is downloaded). Empty documents are skipped.

Imported lazily by ``swarmtrain data``: it pulls in numpy, tokenizers, transformers, datasets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

from protocol.errors import ConfigError
from protocol.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENIZER_FILES,
    Manifest,
    ShardEntry,
    dtype_for_vocab,
    load_manifest,
    tokenizer_sha256,
)

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TEXT_SUFFIXES = frozenset({".txt", ".py", ".md"})
RECORD_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Suffix -> HF ``datasets`` packaged builder of the files holding one document per record."""
_SKIP_DIRS = frozenset({"__pycache__"})
_BATCH_DOCS = 512
_BATCH_CHARS = 8 << 20
_RECORD_BATCH = 1024


def stdlib_corpus(max_files: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files (the offline corpus), sorted; the first
    ``max_files`` of them if given."""
    from peer.task.data import stdlib_files

    files = stdlib_files()
    return files if max_files is None else files[:max_files]


def input_files(inputs: list[Path]) -> list[tuple[Path, str]]:
    """Each input file with its name for the manifest's ``sources`` (relative to the input
    given, so not where the data sits on disk), in reading order. ConfigError for a missing
    input, a file of unknown type, or no files at all."""
    found: list[tuple[Path, str]] = []
    for given in inputs:
        if given.is_dir():
            below: list[tuple[str, Path]] = []
            for dirpath, dirnames, filenames in os.walk(given, followlinks=True):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
                for name in filenames:
                    if not name.startswith("."):
                        file = Path(dirpath, name)
                        below.append((file.relative_to(given).as_posix(), file))
            found.extend((file, f"{given.name}/{rel}" if given.name else rel) for rel, file in sorted(below))
        elif given.is_file():
            found.append((given, given.name))
        else:
            raise ConfigError(
                f"input {str(given)!r}: {'not a file or directory' if given.exists() else 'no such file'}"
            )
    for file, _ in found:
        if file.suffix not in TEXT_SUFFIXES and file.suffix not in RECORD_BUILDERS:
            known = ", ".join(sorted(TEXT_SUFFIXES | RECORD_BUILDERS.keys()))
            raise ConfigError(f"{file}: unknown file type {file.suffix or '(no suffix)'!r} (known: {known})")
    if not found:
        raise ConfigError(f"no input files in {', '.join(repr(str(p)) for p in inputs) or '(none given)'}")
    return found


def read_documents(file: Path, *, text_field: str, cache_dir: Path) -> Iterator[str]:
    """The non-empty documents of one input file, in order; ConfigError naming the file
    (and record) if it cannot be read or a record has no string ``text_field``."""
    if file.suffix in TEXT_SUFFIXES:
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{file}: not UTF-8 text (byte {exc.start})") from exc
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read ({exc.strerror or exc})") from exc
        if text:
            yield text
        return
    yield from _read_records(file, RECORD_BUILDERS[file.suffix], text_field=text_field, cache_dir=cache_dir)


def _read_records(file: Path, builder: str, *, text_field: str, cache_dir: Path) -> Iterator[str]:
    from datasets import load_dataset  # type: ignore[import-untyped]

    # ``data_files`` are glob patterns (and fsspec URLs): read through a link with a plain name.
    link = Path(tempfile.mkdtemp(dir=cache_dir)) / f"input{file.suffix}"
    link.symlink_to(file.resolve())
    index = 0
    try:
        with _quiet_datasets():
            dataset = load_dataset(
                builder, data_files=str(link), split="train", streaming=True, cache_dir=str(cache_dir)
            )
            if dataset.features is not None and text_field not in dataset.features:
                raise ConfigError(f"{file}: no field {text_field!r} (fields: {', '.join(dataset.features)})")
            for batch in dataset.iter(batch_size=_RECORD_BATCH):
                if text_field not in batch:
                    raise ConfigError(f"{file}: record {index}: no field {text_field!r} (fields: {', '.join(batch)})")
                for text in batch[text_field]:
                    if not isinstance(text, str):
                        what = "missing or null" if text is None else f"a {type(text).__name__}, not a string"
                        raise ConfigError(f"{file}: record {index}: field {text_field!r} is {what}")
                    index += 1
                    if text:
                        yield text
    except ConfigError:
        raise
    except Exception as exc:  # pyarrow and datasets raise many types for a bad file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        after = f" (after record {index})" if index else ""
        raise ConfigError(f"{file}: cannot read {builder} records{after}: {detail}") from exc


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets`` logs a multi-line error before raising for a bad file; we report it in one line."""
    hf_logger = logging.getLogger("datasets")
    level = hf_logger.level
    hf_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hf_logger.setLevel(level)


def _documents(files: list[tuple[Path, str]], *, text_field: str, cache_dir: Path) -> Iterator[str]:
    for file, _ in files:
        yield from read_documents(file, text_field=text_field, cache_dir=cache_dir)


def train_tokenizer(files: list[Path], out_dir: Path, *, vocab_size: int) -> Path:
    """Train a byte-level BPE tokenizer on ``files`` (files or directories, read like
    ``prepare``'s inputs; text field "text") and write ``out_dir/tokenizer.json`` and a
    ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` loads offline. Id 0 is
    the EOS token ``<|endoftext|>``. Deterministic: same inputs, same bytes. Returns the
    path of ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    path = out_dir / "tokenizer.json"
    if path.exists():
        raise ConfigError(f"{path}: already exists (choose another output directory or remove it)")
    sources = input_files(files)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with tempfile.TemporaryDirectory(prefix="swarmtrain-tokenizer-") as cache:
        tokenizer.train_from_iterator(_documents(sources, text_field="text", cache_dir=Path(cache)), trainer=trainer)
    assert tokenizer.token_to_id(EOS_TOKEN) == 0, "special tokens come first in a trained vocabulary"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "tokenizer_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_atomic(path, tokenizer.to_str(pretty=True) + "\n")
    logger.info(
        "tokenizer with %d tokens trained on %d files, written to %s", tokenizer.get_vocab_size(), len(sources), path
    )
    return path


def load_tokenizer(tokenizer_dir: Path) -> Any:
    """The fast tokenizer in ``tokenizer_dir`` (``AutoTokenizer``, local files only);
    ConfigError if it does not load, is not a fast tokenizer or has no EOS token."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{tokenizer_dir}: cannot load the tokenizer: {detail}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{tokenizer_dir}: not a fast tokenizer (prepare needs tokenizer.json)")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{tokenizer_dir}: the tokenizer has no eos_token (set it in tokenizer_config.json)")
    return tokenizer


class _SplitWriter:
    """Cuts one split's token stream into rows and writes them to shards as they fill.

    Row i of the stream is tokens[i*seq_len : i*seq_len + seq_len + 1] (consecutive rows
    share one token); the tail shorter than a row is dropped at ``close``. Each shard is
    written under a temporary name and renamed once complete."""

    def __init__(self, out_dir: Path, prefix: str, *, seq_len: int, dtype: str, shard_sequences: int) -> None:
        self.out_dir = out_dir
        self.prefix = prefix
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_sequences = shard_sequences
        self.shards: list[ShardEntry] = []
        self.written: list[Path] = []  # every file created: complete shards and the one being written
        self._carry = np.empty(0, dtype=self.dtype)
        self._file: Any = None
        self._hash = hashlib.sha256()
        self._rows = 0

    def add(self, tokens: np.ndarray) -> None:
        stream = np.concatenate([self._carry, tokens.astype(self.dtype, copy=False)])
        rows = (stream.size - 1) // self.seq_len if stream.size > self.seq_len else 0
        if rows:
            windows = np.lib.stride_tricks.sliding_window_view(stream, self.seq_len + 1)[:: self.seq_len][:rows]
            self._write(windows)
        self._carry = stream[rows * self.seq_len :].copy()

    def _write(self, rows: np.ndarray) -> None:
        while len(rows):
            if self._file is None:
                self._open()
            take = min(len(rows), self.shard_sequences - self._rows)
            data = np.ascontiguousarray(rows[:take]).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._rows += take
            rows = rows[take:]
            if self._rows == self.shard_sequences:
                self._finish()

    def _name(self) -> str:
        return f"{self.prefix}-{len(self.shards):05d}.bin"

    def _open(self) -> None:
        partial = self.out_dir / f".{self._name()}.partial"
        self.written.append(partial)
        self._file = partial.open("wb")
        self._hash = hashlib.sha256()
        self._rows = 0

    def _finish(self) -> None:
        self._file.close()
        self._file = None
        final = self.out_dir / self._name()
        os.replace(self.written[-1], final)
        self.written[-1] = final
        self.shards.append(ShardEntry(file=final.name, sequences=self._rows, sha256="sha256:" + self._hash.hexdigest()))

    def close(self, *, shuffle_seed: int | None = None) -> list[ShardEntry]:
        """Finish the last shard; with ``shuffle_seed``, rewrite the split's rows in a seeded
        random order (``row_order``) into shards of the same sizes. The shards, in order."""
        if self._file is not None:
            self._finish()
        if shuffle_seed is not None and self.shards:
            self._shuffle(shuffle_seed)
        return self.shards

    def _shuffle(self, seed: int) -> None:
        """A peer reads a run of whole shards each round (``peer.task.data_assignment``), so a shard
        must be a random sample of the split, not a stretch of a few documents: rows in
        document order made every round of a tiny Llama run train on one or two source files."""
        row = self.seq_len + 1
        sizes = [entry.sequences for entry in self.shards]
        starts = np.cumsum([0, *sizes])
        sources = [
            np.memmap(self.out_dir / entry.file, dtype=self.dtype, mode="r", shape=(entry.sequences, row))
            for entry in self.shards
        ]
        order = row_order(int(starts[-1]), seed=seed, split=self.prefix)
        rewritten: list[tuple[Path, ShardEntry]] = []
        for index, entry in enumerate(self.shards):
            take = order[starts[index] : starts[index + 1]]
            which = np.searchsorted(starts, take, side="right") - 1
            out = np.empty((len(take), row), dtype=self.dtype)
            for source in np.unique(which):
                picked = which == source
                out[picked] = sources[source][take[picked] - starts[source]]
            data = out.tobytes()
            path = self.out_dir / f".{entry.file}.shuffled"
            self.written.append(path)
            path.write_bytes(data)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            rewritten.append((path, ShardEntry(file=entry.file, sequences=entry.sequences, sha256=digest)))
        del sources
        for path, entry in rewritten:
            os.replace(path, self.out_dir / entry.file)
        self.shards = [entry for _, entry in rewritten]

    def abort(self) -> None:
        """Close and remove every file written (after a failure)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for path in self.written:
            path.unlink(missing_ok=True)


def row_order(rows: int, *, seed: int, split: str) -> np.ndarray:
    """The shuffled split's row p is row ``row_order(...)[p]`` of the split in document order: a
    permutation by sorting a seeded PCG64's raw 64-bit outputs (a bit generator's stream is the
    same in every NumPy version, unlike ``Generator.permutation``)."""
    key = int.from_bytes(hashlib.sha256(f"swarmtrain-rows:{seed}:{split}".encode()).digest()[:8], "big")
    raw = np.random.PCG64(key).random_raw(rows)
    return np.argsort(raw, kind="stable")


def validation_documents(n_documents: int, fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: those whose hash of (seed, index) falls below
    ``fraction``; at least one if ``fraction > 0`` and there are two documents or more, and
    never all of them."""
    if fraction <= 0 or n_documents < 2:
        return set()
    chosen: set[int] = set()
    lowest, highest = (2.0, 0), (-1.0, 0)
    for index in range(n_documents):
        digest = hashlib.sha256(f"swarmtrain-validation:{seed}:{index}".encode()).digest()
        score = int.from_bytes(digest[:8], "big") / 2**64
        if score < fraction:
            chosen.add(index)
        lowest, highest = min(lowest, (score, index)), max(highest, (score, index))
    if not chosen:
        chosen.add(lowest[1])
    if len(chosen) == n_documents:
        chosen.discard(highest[1])
    return chosen


def prepare(
    inputs: list[Path],
    tokenizer_dir: Path,
    out_dir: Path,
    *,
    seq_len: int,
    validation_fraction: float,
    text_field: str = "text",
    shard_sequences: int = 4096,
    seed: int = 0,
    progress: bool = True,
) -> Manifest:
    """Tokenize ``inputs`` into a new (or empty) ``out_dir``: shards and ``manifest.json``
    (written last). Returns the manifest as loaded back. ConfigError, naming the file, for
    bad inputs or a non-empty ``out_dir``; after a failure nothing it wrote is left."""
    out_dir = Path(out_dir)
    if not 8 <= seq_len <= 65536:
        raise ConfigError(f"seq_len {seq_len} is not in [8, 65536]")
    if not 0 <= validation_fraction < 0.5:
        raise ConfigError(f"validation fraction {validation_fraction} is not in [0, 0.5)")
    if shard_sequences < 1:
        raise ConfigError(f"shard sequences {shard_sequences} is below 1")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir}: not an empty directory (prepare writes into a new or empty one)")
    sources = input_files(inputs)
    tok_sha = tokenizer_sha256(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    eos = int(tokenizer.eos_token_id)
    dtype = dtype_for_vocab(vocab_size)
    created = not out_dir.exists()
    with tempfile.TemporaryDirectory(prefix="swarmtrain-prepare-") as cache_name:
        cache = Path(cache_name)
        n_documents = _count_documents(sources, text_field=text_field, cache_dir=cache, progress=progress)
        if n_documents == 0:
            raise ConfigError(f"the inputs hold no non-empty document ({len(sources)} files)")
        held_out = validation_documents(n_documents, validation_fraction, seed)
        out_dir.mkdir(parents=True, exist_ok=True)
        writers = {
            split: _SplitWriter(out_dir, prefix, seq_len=seq_len, dtype=dtype, shard_sequences=shard_sequences)
            for split, prefix in (("train", "train"), ("validation", "val"))
        }
        try:
            tokens = _tokenize(
                _documents(sources, text_field=text_field, cache_dir=cache),
                tokenizer,
                writers,
                held_out=held_out,
                eos=eos,
                vocab_size=vocab_size,
                total=n_documents,
                progress=progress,
            )
            train = writers["train"].close(shuffle_seed=seed)
            validation = writers["validation"].close(shuffle_seed=seed)
            if not train:
                raise ConfigError(
                    f"the inputs hold too few training tokens for one sequence of seq_len + 1 = {seq_len + 1} tokens"
                )
            manifest = Manifest(
                format=FORMAT_VERSION,
                seq_len=seq_len,
                dtype=dtype,
                vocab_size=vocab_size,
                eos_token_id=eos,
                tokenizer_sha256=tok_sha,
                train=train,
                validation=validation,
                documents=n_documents,
                tokens=tokens,
                sources=[name for _, name in sources],
            )
            for name in TOKENIZER_FILES:  # the data and its tokenizer publish together
                if (tokenizer_dir / name).is_file():
                    _copy_atomic(tokenizer_dir / name, out_dir / name)
            _write_atomic(out_dir / MANIFEST_NAME, json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
        except BaseException:
            for writer in writers.values():
                writer.abort()
            (out_dir / f".{MANIFEST_NAME}.tmp").unlink(missing_ok=True)
            for name in TOKENIZER_FILES:
                (out_dir / name).unlink(missing_ok=True)
            if created:
                try:
                    out_dir.rmdir()
                except OSError:
                    pass
            raise
    if not validation and held_out:
        logger.warning("the %d held-out documents hold less than one sequence: no validation data", len(held_out))
    logger.info("prepared %s: %d documents, %d tokens, manifest %s", out_dir, n_documents, tokens, manifest.digest())
    return load_manifest(out_dir)


def _count_documents(files: list[tuple[Path, str]], *, text_field: str, cache_dir: Path, progress: bool) -> int:
    """First pass: check every input and count its documents (the split needs the total)."""
    count = 0
    for file, _ in tqdm(files, desc="checking inputs", unit="file", file=sys.stderr, disable=not progress):
        count += sum(1 for _ in read_documents(file, text_field=text_field, cache_dir=cache_dir))
    return count


def _tokenize(
    documents: Iterator[str],
    tokenizer: Any,
    writers: dict[str, _SplitWriter],
    *,
    held_out: set[int],
    eos: int,
    vocab_size: int,
    total: int,
    progress: bool,
) -> int:
    """Second pass: tokenize in batches and route each document's tokens (EOS appended) to
    its split's writer, in document order. Returns the number of tokens."""
    tokens = 0
    index = 0
    bar = tqdm(total=total, desc="tokenizing", unit="doc", file=sys.stderr, disable=not progress)
    with bar:
        for batch in _batches(documents):
            ids = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
            split_ids: dict[str, list[int]] = {"train": [], "validation": []}
            for doc_ids in ids:
                target = split_ids["validation" if index in held_out else "train"]
                target.extend(doc_ids)
                target.append(eos)
                tokens += len(doc_ids) + 1
                index += 1
            for split, flat in split_ids.items():
                if flat:
                    array = np.asarray(flat, dtype=np.int64)
                    if int(array.max()) >= vocab_size or int(array.min()) < 0:
                        raise ConfigError(f"the tokenizer produced an id outside [0, {vocab_size})")
                    writers[split].add(array)
            bar.update(len(batch))
    if index != total:
        raise ConfigError(f"the inputs changed while being read ({total} documents, then {index})")
    return tokens


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _copy_atomic(source: Path, path: Path) -> None:
    """Copy ``source``'s bytes to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
