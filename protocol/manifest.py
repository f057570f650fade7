"""The format of a prepared token dataset: ``manifest.json`` and its shard files.

``swarmtrain data prepare`` writes a directory holding ``manifest.json`` and shards
``train-00000.bin``, ``train-00001.bin``, ..., ``val-00000.bin``, ... Each shard is raw
little-endian integers of the manifest's ``dtype`` (``uint16`` when the vocabulary fits,
else ``uint32``), a whole number of rows; a row is one training sequence of ``seq_len + 1``
tokens (inputs ``row[:-1]``, targets ``row[1:]``).

Every party of a run must train on the same data: ``Manifest.digest()`` is a SHA-256 over a
canonical JSON form of the validated manifest, and the manifest holds the SHA-256 of every
shard and of the tokenizer, so the one digest in the run spec pins all the bytes. Loading
checks the manifest and the shard sizes (cheap); ``verify_shards`` hashes every byte.

This module is pure (pydantic and the standard library only): the coordinator and the peers
read manifests without importing numpy, torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.errors import ConfigError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION: Literal[1] = 1
UINT16_MAX_VOCAB = 65536
"""Largest vocabulary whose token ids fit in ``uint16`` shards."""
ITEMSIZE = {"uint16": 2, "uint32": 4}
"""Bytes per token of each shard dtype."""
_SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_HASH_CHUNK = 1 << 20

Dtype = Literal["uint16", "uint32"]


def dtype_for_vocab(vocab_size: int) -> Dtype:
    """The shard dtype of a vocabulary: ``uint16`` if every id fits, else ``uint32``."""
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def _check_sha256(value: str) -> str:
    if not _SHA256_RE.match(value):
        raise ValueError("must be 'sha256:' followed by 64 lowercase hex digits")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


class ShardEntry(_Model):
    """One shard file of the manifest."""

    file: str
    """File name inside the data directory (a plain name: no '/', '\\' or '..')."""
    sequences: Annotated[int, Field(ge=1)]
    """Rows (sequences of ``seq_len + 1`` tokens) in the file."""
    sha256: str
    """``sha256:<hex>`` of the file's bytes."""

    @field_validator("file")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        # A manifest may come from someone else: never let it name a file outside its directory.
        if not _FILE_RE.match(value) or ".." in value or len(value) > 255:
            raise ValueError("must be a plain file name inside the data directory (no '/', '\\', '..' or leading '.')")
        return value

    @field_validator("sha256")
    @classmethod
    def _sha256_form(cls, value: str) -> str:
        return _check_sha256(value)


class Manifest(_Model):
    """What a prepared data directory holds; see the module docstring for the layout."""

    format: Literal[1]
    """Version of this layout."""
    seq_len: Annotated[int, Field(ge=8, le=65536)]
    """Tokens per training sequence (a row holds ``seq_len + 1``)."""
    dtype: Dtype
    """Integer type of the shards (little-endian); fixed by ``vocab_size``."""
    vocab_size: Annotated[int, Field(ge=2)]
    """Size of the tokenizer's vocabulary (including its added tokens)."""
    eos_token_id: Annotated[int, Field(ge=0)]
    """Token appended after every document."""
    tokenizer_sha256: str
    """``sha256:<hex>`` of the tokenizer's ``tokenizer.json``."""
    train: Annotated[list[ShardEntry], Field(min_length=1)]
    """Training shards, in order."""
    validation: list[ShardEntry]
    """Held-out shards, in order (empty if nothing was held out)."""
    documents: Annotated[int, Field(ge=1)]
    """Documents read (both splits)."""
    tokens: Annotated[int, Field(ge=1)]
    """Tokens of those documents, one EOS each included (both splits, before cutting rows)."""
    sources: list[str]
    """Names of the input files (informational: not where they are on disk)."""

    @field_validator("tokenizer_sha256")
    @classmethod
    def _tokenizer_sha256_form(cls, value: str) -> str:
        return _check_sha256(value)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.dtype != dtype_for_vocab(self.vocab_size):
            raise ValueError(
                f"dtype {self.dtype!r} does not match vocab_size {self.vocab_size} "
                f"(expected {dtype_for_vocab(self.vocab_size)!r})"
            )
        if self.eos_token_id >= self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is not below vocab_size {self.vocab_size}")
        names = [entry.file for entry in (*self.train, *self.validation)]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise ValueError(f"shard file {duplicate!r} is listed twice")
        return self

    def digest(self) -> str:
        """``sha256:<hex>`` of the canonical JSON of this manifest: what a run spec names."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @property
    def itemsize(self) -> int:
        """Bytes per token in the shards."""
        return ITEMSIZE[self.dtype]

    def shard_bytes(self, entry: ShardEntry) -> int:
        """The exact size of ``entry``'s file."""
        return entry.sequences * (self.seq_len + 1) * self.itemsize

    def train_sequences(self) -> int:
        """Rows in all training shards."""
        return sum(entry.sequences for entry in self.train)

    def validation_sequences(self) -> int:
        """Rows in all held-out shards."""
        return sum(entry.sequences for entry in self.validation)

    def total_bytes(self) -> int:
        """Bytes of all shard files (what ``verify_shards`` reads)."""
        return sum(self.shard_bytes(entry) for entry in (*self.train, *self.validation))


def load_manifest(directory: str | Path, *, require_shards: bool = True) -> Manifest:
    """Read and validate ``directory/manifest.json`` and check that every shard file exists
    with the size its row count implies (``require_shards`` False: only those present, for a
    directory a peer fills as it needs them). ConfigError (one line naming the file or field)
    otherwise. Does not hash the shards: that is ``verify_shards``."""
    root = Path(directory)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ConfigError(f"{root}: {'is not a directory' if root.exists() else 'no such directory'}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file (not a directory made by `swarmtrain data prepare`?)") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    manifest = parse_manifest(text, source=str(path))
    for entry in (*manifest.train, *manifest.validation):
        shard = root / entry.file
        if require_shards or shard.exists():
            check_shard_size(shard, manifest, entry)
    return manifest


def parse_manifest(text: str, *, source: str) -> Manifest:
    """A manifest from its JSON text; ConfigError naming ``source`` and the first problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from exc
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(err) for err in exc.errors()]
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise ConfigError(f"{source}: {problems[0]}{more}") from exc


def check_shard_size(shard: Path, manifest: Manifest, entry: ShardEntry) -> None:
    """ConfigError unless ``shard`` is a regular file of the size ``entry`` implies."""
    expected = manifest.shard_bytes(entry)
    try:
        actual = shard.stat().st_size
    except FileNotFoundError as exc:
        raise ConfigError(f"{shard}: shard file listed in {MANIFEST_NAME} is missing") from exc
    except OSError as exc:
        raise ConfigError(f"{shard}: cannot read ({exc.strerror or exc})") from exc
    if not shard.is_file():
        raise ConfigError(f"{shard}: shard listed in {MANIFEST_NAME} is not a regular file")
    if actual != expected:
        raise ConfigError(
            f"{shard}: {actual} bytes, expected {expected} ({entry.sequences} sequences of "
            f"{manifest.seq_len + 1} {manifest.dtype} tokens): truncated, or not the file the manifest lists"
        )


def verify_shards(directory: str | Path, manifest: Manifest, progress: Callable[[int], None] | None = None) -> None:
    """Hash every shard file in full and compare with the manifest; ConfigError naming the
    first file that differs. ``progress`` is called with the number of bytes read after each
    chunk (for a progress bar)."""
    root = Path(directory)
    for entry in (*manifest.train, *manifest.validation):
        shard = root / entry.file
        actual = file_sha256(shard, progress=progress)
        if actual != entry.sha256:
            raise ConfigError(
                f"{shard}: content does not match {MANIFEST_NAME} (sha256 {actual}, manifest says {entry.sha256})"
            )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""A tokenizer directory's files (``tokenizer.json`` is its identity; the others configure
how transformers loads it): a prepared data directory carries a copy, and so does an export."""


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """``sha256:<hex>`` of ``tokenizer_dir/tokenizer.json``, the tokenizer's identity in a
    manifest and a run spec; ConfigError if the file is absent."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a tokenizer directory holds tokenizer.json)")
    return file_sha256(path)


def file_sha256(path: Path, *, progress: Callable[[int], None] | None = None) -> str:
    """``sha256:<hex>`` of a file's bytes, read in chunks; ConfigError if unreadable."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                if progress is not None:
                    progress(len(chunk))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return "sha256:" + digest.hexdigest()


def weights_sha256(directory: str | Path) -> str:
    """``sha256:<hex>`` of a directory's ``*.safetensors`` files (names and bytes, in name order):
    what a continued-pretraining spec names (``task.causal_lm.weights``). ConfigError if none."""
    root = Path(directory)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise ConfigError(f"{root}: no *.safetensors weights in it")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return "sha256:" + digest.hexdigest()


def _describe(err: Any) -> str:
    """One pydantic error as ``field: what is wrong (got ...)``."""
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in err["loc"]).lstrip(".")
    field = field or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{field}: unknown field"
    if kind == "missing":
        return f"{field}: required field is missing"
    message = err["msg"].removeprefix("Value error, ")
    if kind.startswith("value_error"):
        return f"{field}: {message}"
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{field}: {message} (got {got})"
