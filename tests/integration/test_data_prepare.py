"""``swarmtrain data``: a real tokenizer trained and a real mix of inputs (.py files, JSON
Lines, Parquet) tokenized into shards; the shards hold exactly the input documents, split
by whole documents, and the same inputs give the same manifest digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.errors import ConfigError
from protocol.manifest import Manifest, load_manifest, tokenizer_sha256
from swarmtrain import dataprep
from swarmtrain.cli import main

SEQ_LEN = 32
VOCAB = 512
FRACTION = 0.1
SHARD_SEQUENCES = 2000
JSONL_TEXTS = ["first record\n", "", "second record, with ünïcödé ✓\n", "third\trecord"]
PARQUET_TEXTS = ["a parquet row", "another parquet row\n" * 3]
MD_TEXT = "# Title\n\nSome *markdown* text.\n"


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` sets HIVEMIND_LOGLEVEL if unset: keep it out of the other tests' environment."""
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "WARNING")


@pytest.fixture(scope="module")
def py_files() -> list[Path]:
    """40 ASCII stdlib sources (so any slice of tokens decodes to a slice of the text)."""
    return [path for path in dataprep.stdlib_corpus() if path.read_bytes().isascii()][:40]


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("records")
    lines = [json.dumps({"id": i, "text": text}) for i, text in enumerate(JSONL_TEXTS)]
    (directory / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": PARQUET_TEXTS, "n": [1, 2]}), directory / "b.parquet")
    (directory / "c.md").write_text(MD_TEXT)
    (directory / ".hidden.csv").write_text("skipped: hidden")
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, py_files: list[Path]) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    dataprep.train_tokenizer(py_files, out, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def prepared(
    tmp_path_factory: pytest.TempPathFactory, py_files: list[Path], records_dir: Path, tokenizer_dir: Path
) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("prepared") / "data"
    manifest = dataprep.prepare(
        [*py_files, records_dir],
        tokenizer_dir,
        out,
        seq_len=SEQ_LEN,
        validation_fraction=FRACTION,
        shard_sequences=SHARD_SEQUENCES,
        progress=False,
    )
    return out, manifest


def _documents(py_files: list[Path]) -> list[str]:
    """The documents in reading order: the files as given, then the directory sorted."""
    texts = [path.read_text() for path in py_files]
    return texts + [t for t in JSONL_TEXTS if t] + PARQUET_TEXTS + [MD_TEXT]


SPLIT_PREFIX = {"train": "train", "validation": "val"}


def _stream(directory: Path, manifest: Manifest, split: str) -> np.ndarray:
    """A split's token stream rebuilt from its rows (consecutive rows share one token)."""
    rows = [
        np.fromfile(directory / entry.file, dtype="<u2").reshape(entry.sequences, SEQ_LEN + 1)
        for entry in getattr(manifest, split)
    ]
    if not rows:
        return np.empty(0, dtype=np.int64)
    shuffled = np.concatenate(rows).astype(np.int64)
    table = np.empty_like(shuffled)  # back in document order: row p of the split is row order[p]
    table[dataprep.row_order(len(shuffled), seed=0, split=SPLIT_PREFIX[split])] = shuffled
    return np.concatenate([table[0], table[1:, 1:].reshape(-1)])


def _complete_documents(tokenizer: Any, stream: np.ndarray, eos: int) -> list[str]:
    """The documents whose tokens and EOS are all in ``stream``, decoded."""
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def test_tokenizer_training_is_deterministic_and_loads_with_transformers(
    tmp_path: Path, py_files: list[Path], tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    again = tmp_path / "again"
    assert main(["data", "tokenizer", "--out", str(again), "--vocab-size", str(VOCAB), *map(str, py_files)]) == 0
    out = capsys.readouterr().out
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert f"tokenizer: {tokenizer_sha256(tokenizer_dir)}" in out.splitlines()
    tokenizer = dataprep.load_tokenizer(again)
    assert tokenizer.is_fast and tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert len(tokenizer) == VOCAB
    text = "def f(x):\n    return x  # ünïcödé\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_shards_hold_the_input_documents_split_by_document(
    prepared: tuple[Path, Manifest], py_files: list[Path], records_dir: Path, tokenizer_dir: Path
) -> None:
    out, manifest = prepared
    documents = _documents(py_files)
    assert manifest.documents == len(documents)
    assert manifest.seq_len == SEQ_LEN and manifest.dtype == "uint16" and manifest.vocab_size == VOCAB
    assert manifest.tokenizer_sha256 == tokenizer_sha256(tokenizer_dir)
    assert manifest.sources[:2] == [py_files[0].name, py_files[1].name]
    assert manifest.sources[-3:] == [f"{records_dir.name}/{name}" for name in ("a.jsonl", "b.parquet", "c.md")]
    assert load_manifest(out) == manifest
    assert len(manifest.train) > 1, "the test should span several shards"
    assert all(entry.sequences == SHARD_SEQUENCES for entry in manifest.train[:-1])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "manifest.json",
            "tokenizer.json",
            "tokenizer_config.json",
            *(e.file for e in (*manifest.train, *manifest.validation)),
        ]
    )

    tokenizer = dataprep.load_tokenizer(tokenizer_dir)
    held_out = dataprep.validation_documents(len(documents), FRACTION, seed=0)
    assert held_out and len(held_out) < len(documents)
    expected = {
        "train": [doc for i, doc in enumerate(documents) if i not in held_out],
        "validation": [doc for i, doc in enumerate(documents) if i in held_out],
    }
    total = 0
    for split, docs in expected.items():
        stream = _stream(out, manifest, split)
        split_tokens = sum(len(tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1 for doc in docs)
        total += split_tokens
        # Only the tail shorter than a row is dropped...
        assert 0 <= split_tokens - len(stream) < (SEQ_LEN if len(stream) else SEQ_LEN + 1)
        # ...and every complete document in the rows is the next input document of that split:
        # nothing lost, reordered or mixed across the splits.
        decoded = _complete_documents(tokenizer, stream, manifest.eos_token_id)
        assert decoded == docs[: len(decoded)]
    assert {documents[i] for i in held_out}.isdisjoint(expected["train"])
    assert manifest.tokens == total


def test_same_inputs_same_digest_through_the_cli(
    tmp_path: Path,
    prepared: tuple[Path, Manifest],
    py_files: list[Path],
    records_dir: Path,
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, manifest = prepared
    out = tmp_path / "again"
    argv = ["data", "prepare", *map(str, [*py_files, records_dir]), "--tokenizer", str(tokenizer_dir)]
    argv += ["--out", str(out), "--seq-len", str(SEQ_LEN), "--validation-fraction", str(FRACTION)]
    assert main([*argv, "--shard-sequences", str(SHARD_SEQUENCES), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"manifest: {manifest.digest()}" in lines
    assert f"tokenizer: {manifest.tokenizer_sha256}" in lines

    assert main(["data", "verify", str(out), "--no-progress"]) == 0
    assert f"manifest: {manifest.digest()}" in capsys.readouterr().out.splitlines()
    shard = out / manifest.train[0].file
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["data", "verify", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"swarmtrain data: error: {shard}: content does not match")


def _write_bad(directory: Path, case: str) -> Path:
    if case == "unknown type":
        path = directory / "table.csv"
        path.write_text("a,b\n")
    elif case == "missing field":
        path = directory / "x.jsonl"
        path.write_text('{"body": "no text here"}\n')
    elif case == "bad json":
        path = directory / "x.jsonl"
        path.write_text('{"text": "ok"}\n{"text": \n')
    elif case == "null text":
        path = directory / "x.parquet"
        pq.write_table(pa.table({"text": ["ok", None]}), path)
    elif case == "number text":
        path = directory / "x.jsonl"
        path.write_text('{"text": 7}\n')
    elif case == "not utf-8":
        path = directory / "x.txt"
        path.write_bytes(b"caf\xe9\n")
    elif case == "empty directory":
        path = directory / "empty"
        path.mkdir()
    elif case == "too short":
        path = directory / "x.txt"
        path.write_text("tiny")
    return path


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown type", "table.csv: unknown file type '.csv'"),
        ("missing field", "x.jsonl: no field 'text' (fields: body)"),
        ("bad json", "x.jsonl: cannot read json records"),
        ("null text", "x.parquet: record 1: field 'text' is missing or null"),
        ("number text", "x.jsonl: record 0: field 'text' is a int, not a string"),
        ("not utf-8", "x.txt: not UTF-8 text (byte 3)"),
        ("empty directory", "no input files in"),
        ("too short", "too few training tokens for one sequence of seq_len + 1 = 33 tokens"),
    ],
)
def test_bad_inputs_are_one_line_errors_and_leave_nothing(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], case: str, expected: str
) -> None:
    bad = _write_bad(tmp_path, case)
    out = tmp_path / "out"
    argv = ["data", "prepare", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(out), "--seq-len", "32"]
    assert main([*argv, "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("swarmtrain data: error: ") and expected in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["prepare", "IN", "--tokenizer", "TOK", "--out", "OUT", "--seq-len", "4"], "--seq-len 4 is not in [8, 65536]"),
        (
            ["prepare", "IN", "--tokenizer", "TOK", "--out", "OUT", "--seq-len", "32", "--validation-fraction", "0.5"],
            "--validation-fraction 0.5 is not in [0, 0.5)",
        ),
        (["prepare", "nowhere", "--tokenizer", "TOK", "--out", "OUT", "--seq-len", "32"], "input 'nowhere': no such"),
        (["prepare", "IN", "--tokenizer", "IN", "--out", "OUT", "--seq-len", "32"], "tokenizer.json: no such file"),
        (["prepare", "IN", "--tokenizer", "TOK", "--out", "IN", "--seq-len", "32"], "is not an empty directory"),
        (["tokenizer", "--out", "OUT", "--vocab-size", "299", "--stdlib"], "--vocab-size 299 is not in [300, 1048576]"),
        (["tokenizer", "--out", "OUT", "--vocab-size", "512"], "give either --stdlib or INPUT"),
        (["tokenizer", "--out", "OUT", "--vocab-size", "512", "IN", "--max-files", "3"], "--max-files needs --stdlib"),
        (["verify", "OUT"], "OUT: no such directory"),
    ],
)
def test_bad_flags(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("text")
    names = {"IN": str(tmp_path / "in"), "TOK": str(tokenizer_dir), "OUT": str(tmp_path / "out")}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["data", *(names.get(arg, arg) for arg in argv)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("swarmtrain data: error: ")
    assert expected.replace("OUT", str(tmp_path / "out")) in err[0]


def test_a_non_empty_output_directory_is_refused(tmp_path: Path, py_files: list[Path], tokenizer_dir: Path) -> None:
    (tmp_path / "keep.txt").write_text("not ours")
    with pytest.raises(ConfigError, match="not an empty directory"):
        dataprep.prepare(py_files[:2], tokenizer_dir, tmp_path, seq_len=SEQ_LEN, validation_fraction=0, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_validation_documents() -> None:
    assert dataprep.validation_documents(1, 0.4, seed=0) == set()
    assert dataprep.validation_documents(100, 0.0, seed=0) == set()
    assert len(dataprep.validation_documents(2, 0.001, seed=0)) == 1  # at least one
    assert len(dataprep.validation_documents(2, 0.499, seed=3)) == 1  # never all
    many = dataprep.validation_documents(10_000, 0.02, seed=0)
    assert 150 < len(many) < 250
    assert many == dataprep.validation_documents(10_000, 0.02, seed=0)
    assert many != dataprep.validation_documents(10_000, 0.02, seed=1)


def test_record_file_names_are_not_patterns(tmp_path: Path) -> None:
    """HF ``datasets`` reads ``data_files`` as glob patterns: a name with '[' or '*' must still
    read that one file, not another that the pattern matches."""
    odd = tmp_path / "odd[1]*.jsonl"
    odd.write_text('{"text": "the right file"}\n')
    (tmp_path / "odd1-decoy.jsonl").write_text('{"text": "a decoy"}\n')
    documents = dataprep.read_documents(odd, text_field="text", cache_dir=tmp_path)
    assert list(documents) == ["the right file"]
