"""protocol.manifest: a prepared data directory is checked before anything trains on it, and
every problem is one line naming the file or field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import ConfigError
from protocol.manifest import MANIFEST_NAME, Manifest, load_manifest, tokenizer_sha256, verify_shards

SEQ_LEN = 8
ROW_BYTES = (SEQ_LEN + 1) * 2  # uint16


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _shard(directory: Path, name: str, rows: int, fill: int) -> dict[str, Any]:
    data = bytes([fill % 256, 0]) * (rows * (SEQ_LEN + 1))
    (directory / name).write_bytes(data)
    return {"file": name, "sequences": rows, "sha256": _sha(data)}


def _fields(directory: Path) -> dict[str, Any]:
    return {
        "format": 1,
        "seq_len": SEQ_LEN,
        "dtype": "uint16",
        "vocab_size": 512,
        "eos_token_id": 0,
        "tokenizer_sha256": _sha(b"tokenizer"),
        "train": [_shard(directory, "train-00000.bin", 3, 1), _shard(directory, "train-00001.bin", 2, 2)],
        "validation": [_shard(directory, "val-00000.bin", 1, 3)],
        "documents": 4,
        "tokens": 60,
        "sources": ["a.py", "b.jsonl"],
    }


def _write(directory: Path, fields: dict[str, Any], **dump: Any) -> Path:
    (directory / MANIFEST_NAME).write_text(json.dumps(fields, **dump))
    return directory


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return _write(tmp_path, _fields(tmp_path), indent=2)


def _error(directory: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_manifest(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_valid_directory_loads_and_verifies(data_dir: Path) -> None:
    manifest = load_manifest(data_dir)
    assert manifest.train_sequences() == 5
    assert manifest.validation_sequences() == 1
    assert manifest.itemsize == 2
    assert manifest.total_bytes() == 6 * ROW_BYTES
    seen: list[int] = []
    verify_shards(data_dir, manifest, progress=seen.append)
    assert sum(seen) == manifest.total_bytes()


def test_digest_ignores_key_order_and_formatting_but_not_values(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    fields = _fields(one)
    _write(one, fields, indent=2)
    _fields(two)  # the same shard bytes
    reordered = {key: fields[key] for key in reversed(list(fields))}
    reordered["train"] = [{key: entry[key] for key in reversed(list(entry))} for entry in fields["train"]]
    _write(two, reordered, separators=(",", ":"))
    digest = load_manifest(one).digest()
    assert digest == load_manifest(two).digest()
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert Manifest.model_validate({**fields, "documents": 5}).digest() != digest


def test_missing_directory_and_manifest(tmp_path: Path) -> None:
    assert _error(tmp_path / "absent") == f"{tmp_path / 'absent'}: no such directory"
    message = _error(tmp_path)
    assert message.startswith(f"{tmp_path / MANIFEST_NAME}: no such file")


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text('{"format": 1,\n  "seq_len": }')
    message = _error(tmp_path)
    assert message.startswith(f"{tmp_path / MANIFEST_NAME}: not valid JSON: ")
    assert "line 2" in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"seq_len": 4}, "seq_len: Input should be greater than or equal to 8 (got 4)"),
        ({"seq_len": "32"}, "seq_len: Input should be a valid integer (got '32')"),
        ({"format": 2}, "format: Input should be 1 (got 2)"),
        ({"colour": "red"}, "colour: unknown field"),
        ({"dtype": "uint32"}, "dtype 'uint32' does not match vocab_size 512 (expected 'uint16')"),
        ({"eos_token_id": 512}, "eos_token_id 512 is not below vocab_size 512"),
        ({"tokenizer_sha256": "abc"}, "tokenizer_sha256: must be 'sha256:' followed by 64 lowercase hex digits"),
        ({"train": []}, "train: List should have at least 1 item after validation, not 0"),
    ],
)
def test_invalid_fields_are_named(data_dir: Path, change: dict[str, Any], expected: str) -> None:
    fields = {**json.loads((data_dir / MANIFEST_NAME).read_text()), **change}
    _write(data_dir, fields)
    message = _error(data_dir)
    assert message.startswith(f"{data_dir / MANIFEST_NAME}: ")
    assert expected in message


def test_missing_field_and_several_problems(data_dir: Path) -> None:
    fields = json.loads((data_dir / MANIFEST_NAME).read_text())
    del fields["tokens"]
    _write(data_dir, fields)
    assert _error(data_dir).endswith("tokens: required field is missing")
    fields["documents"] = 0
    _write(data_dir, fields)
    assert _error(data_dir).endswith("(and 1 more problem)")


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "sub/train.bin", "..", ".hidden", "a\\b.bin"])
def test_shard_names_cannot_leave_the_directory(data_dir: Path, name: str) -> None:
    fields = json.loads((data_dir / MANIFEST_NAME).read_text())
    fields["train"][0]["file"] = name
    _write(data_dir, fields)
    assert "train[0].file: must be a plain file name inside the data directory" in _error(data_dir)


def test_a_shard_listed_twice(data_dir: Path) -> None:
    fields = json.loads((data_dir / MANIFEST_NAME).read_text())
    fields["validation"] = [fields["train"][0]]
    _write(data_dir, fields)
    assert "shard file 'train-00000.bin' is listed twice" in _error(data_dir)


def test_missing_shard(data_dir: Path) -> None:
    (data_dir / "train-00001.bin").unlink()
    assert _error(data_dir) == f"{data_dir / 'train-00001.bin'}: shard file listed in manifest.json is missing"


def test_wrong_shard_size_names_file_and_both_sizes(data_dir: Path) -> None:
    shard = data_dir / "val-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    message = _error(data_dir)
    assert message.startswith(f"{shard}: {ROW_BYTES - 2} bytes, expected {ROW_BYTES} ")
    assert "1 sequences of 9 uint16 tokens" in message


def test_tampered_shard_fails_verification(data_dir: Path) -> None:
    manifest = load_manifest(data_dir)
    shard = data_dir / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    load_manifest(data_dir)  # same size: only hashing notices
    with pytest.raises(ConfigError) as info:
        verify_shards(data_dir, manifest)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{shard}: content does not match manifest.json (sha256 sha256:")
    assert f"manifest says {manifest.train[1].sha256}" in message


def test_tokenizer_sha256(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json: no such file"):
        tokenizer_sha256(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": {}}')
    assert tokenizer_sha256(tmp_path) == _sha(b'{"model": {}}')
