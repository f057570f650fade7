"""``swarmtrain data tokenizer|prepare|verify|weights``: make and check a run's token data offline.

``tokenizer`` trains a byte-level BPE tokenizer; ``prepare`` tokenizes text into shards and
prints the ``manifest`` and ``tokenizer`` digests that go into the run spec's ``[data]``
table; ``verify`` hashes a prepared directory against its manifest; ``weights`` prints the
digest of a directory of safetensors weights (continued pretraining). Flags are checked
before the heavy imports (tokenizers, transformers, datasets), which ``swarmtrain.dataprep``
pulls in only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError
from protocol.manifest import MANIFEST_NAME, load_manifest, tokenizer_sha256, verify_shards, weights_sha256

MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 65536
MIN_VOCAB = 300
"""Below this a byte-level BPE has almost no merges (it starts from 256 bytes + EOS)."""
MAX_VOCAB = 2**20


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "data",
        help="prepare token data for a causal_lm run (tokenizer, shards, checks)",
        description="Prepare token data offline: train a tokenizer, tokenize text into shards, verify shards.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    actions.required = True

    tok = actions.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer",
        description="Train a byte-level BPE tokenizer (EOS <|endoftext|> = id 0) on text inputs or on the "
        "Python standard library; write tokenizer.json and tokenizer_config.json into --out.",
    )
    tok.add_argument("inputs", nargs="*", type=Path, metavar="INPUT", help="files or directories of text")
    tok.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write the tokenizer into")
    tok.add_argument("--vocab-size", type=int, required=True, metavar="N", help="tokens in the vocabulary")
    tok.add_argument("--stdlib", action="store_true", help="train on the Python standard library's sources")
    tok.add_argument("--max-files", type=int, default=None, metavar="K", help="with --stdlib: the first K files only")
    tok.set_defaults(run=run_tokenizer)

    prep = actions.add_parser(
        "prepare",
        help="tokenize text into shards and a manifest; print the digests for the run spec",
        description="Tokenize text (.txt/.py/.md files, .jsonl/.json records, .parquet rows) into "
        "shards of sequences of --seq-len + 1 tokens, plus manifest.json, in a new directory. "
        "Prints the manifest and tokenizer digests the run spec's [data] table names.",
    )
    prep.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files or directories")
    prep.add_argument("--tokenizer", type=Path, required=True, metavar="DIR", help="directory with tokenizer.json")
    prep.add_argument("--out", type=Path, required=True, metavar="DIR", help="new or empty directory to write")
    prep.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per training sequence")
    prep.add_argument(
        "--validation-fraction", type=float, default=0.02, metavar="F", help="documents held out (default 0.02)"
    )
    prep.add_argument("--text-field", default="text", metavar="NAME", help="record field of the text (default text)")
    prep.add_argument(
        "--shard-sequences",
        type=int,
        default=4096,
        metavar="N",
        help="sequences per shard file (default 4096: a peer fetches the shards its pages read, so small ones "
        "keep what it fetches near what it trains)",
    )
    prep.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the validation split (default 0)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    prep.set_defaults(run=run_prepare)

    ver = actions.add_parser(
        "verify",
        help="hash every shard of a prepared directory against its manifest",
        description="Check a prepared directory: manifest, shard sizes and the SHA-256 of every shard.",
    )
    ver.add_argument("directory", type=Path, metavar="DIR")
    ver.add_argument("--no-progress", action="store_true", help="no progress bar")
    ver.set_defaults(run=run_verify)

    serve = actions.add_parser(
        "serve",
        help="publish a prepared directory over HTTP for peers to fetch (the spec's data.url)",
        description="Serve DIR's files over HTTP (range requests, so broken transfers resume), read-only: "
        "put http://HOST:PORT/ in the run spec's [data] url. Any static file server (nginx, a bucket) does too.",
    )
    serve.add_argument("directory", type=Path, metavar="DIR", help="a directory made by `swarmtrain data prepare`")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8090, help="TCP port (default 8090; 0: any free port)")
    serve.set_defaults(run=run_serve)

    fetch = actions.add_parser(
        "fetch",
        help="fetch a run's published data (all of it, or the first GB) and verify it",
        description="Fetch the prepared data a run spec publishes (data.url) into a directory, every file "
        "checked against the spec's digests; a broken transfer resumes. Peers fetch what they need by "
        "themselves: this is for a mirror, or a machine that fetches ahead.",
    )
    fetch.add_argument("spec", type=Path, metavar="SPEC", help="the run spec (TOML) with [data] url")
    fetch.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to put it (default: where a peer of the run looks, as `swarmtrain peer --data-dir`)",
    )
    fetch.add_argument("--cap", type=float, default=None, metavar="GB", help="stop at this many GB of shards")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bar")
    fetch.set_defaults(run=run_fetch)

    weights = actions.add_parser(
        "weights",
        help="print the digest of a directory of safetensors weights (continued pretraining)",
        description="Print the digest of DIR's *.safetensors files, for task.causal_lm.weights in a run spec.",
    )
    weights.add_argument("directory", type=Path, metavar="DIR")
    weights.set_defaults(run=run_weights)


def run_weights(args: argparse.Namespace) -> int:
    print(f"weights: {weights_sha256(args.directory)}")
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        raise ConfigError(f"--vocab-size {args.vocab_size} is not in [{MIN_VOCAB}, {MAX_VOCAB}]")
    if args.stdlib == bool(args.inputs):
        raise ConfigError("give either --stdlib or INPUT files/directories (one of the two)")
    if args.max_files is not None and (not args.stdlib or args.max_files < 1):
        raise ConfigError("--max-files needs --stdlib and a value >= 1")
    _check_inputs(args.inputs)
    if (args.out / "tokenizer.json").exists():
        raise ConfigError(f"{args.out / 'tokenizer.json'}: already exists (choose another --out or remove it)")
    from swarmtrain import dataprep

    files = dataprep.stdlib_corpus(args.max_files) if args.stdlib else list(args.inputs)
    path = dataprep.train_tokenizer(files, args.out, vocab_size=args.vocab_size)
    print(f"tokenizer written to {path}")
    print(f"tokenizer: {tokenizer_sha256(args.out)}")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    if not MIN_SEQ_LEN <= args.seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"--seq-len {args.seq_len} is not in [{MIN_SEQ_LEN}, {MAX_SEQ_LEN}]")
    if not 0 <= args.validation_fraction < 0.5:
        raise ConfigError(f"--validation-fraction {args.validation_fraction} is not in [0, 0.5)")
    if args.shard_sequences < 1:
        raise ConfigError(f"--shard-sequences {args.shard_sequences} is below 1")
    if not args.text_field:
        raise ConfigError("--text-field is empty")
    _check_inputs(args.inputs)
    tokenizer_sha256(args.tokenizer)  # fails fast if there is no tokenizer.json
    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} is not an empty directory")
    from swarmtrain import dataprep

    manifest = dataprep.prepare(
        list(args.inputs),
        args.tokenizer,
        out,
        seq_len=args.seq_len,
        validation_fraction=args.validation_fraction,
        text_field=args.text_field,
        shard_sequences=args.shard_sequences,
        seed=args.seed,
        progress=not args.no_progress,
    )
    row = f"sequences of {manifest.seq_len} + 1 {manifest.dtype} tokens"
    print(
        f"prepared {out}: {manifest.documents} documents, {manifest.tokens} tokens (vocabulary {manifest.vocab_size})"
    )
    print(f"train: {manifest.train_sequences()} {row} in {len(manifest.train)} shard(s)")
    print(f"validation: {manifest.validation_sequences()} sequences in {len(manifest.validation)} shard(s)")
    print(f"manifest: {manifest.digest()}")
    print(f"tokenizer: {manifest.tokenizer_sha256}")
    print(f'(run spec: [data] source = "tokens", path = "{out}", and the two digests above as manifest and tokenizer)')
    return 0


def run_verify(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.directory)
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tqdm(
        total=manifest.total_bytes(),
        unit="B",
        unit_scale=True,
        desc="hashing shards",
        file=sys.stderr,
        disable=args.no_progress,
    ) as bar:
        verify_shards(args.directory, manifest, progress=bar.update)
    shards = len(manifest.train) + len(manifest.validation)
    print(f"{args.directory}: ok ({shards} shards match {MANIFEST_NAME})")
    print(f"manifest: {manifest.digest()}")
    print(f"tokenizer: {manifest.tokenizer_sha256}")
    return 0


def _check_inputs(inputs: list[Path]) -> None:
    for path in inputs:
        if not path.exists():
            raise ConfigError(f"input {str(path)!r}: no such file or directory")


def run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    manifest = load_manifest(args.directory)  # a prepared directory, whole
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((args.host, args.port))  # no SO_REUSEPORT: a port in use is refused, never shared
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({exc.strerror}): choose another --port") from exc
    sock.listen(2048)  # listening before the line below: a client that read it may connect at once
    port = sock.getsockname()[1]
    app = Starlette(routes=[Mount("/", app=StaticFiles(directory=str(args.directory)))])
    shards = len(manifest.train) + len(manifest.validation)
    print(
        f"serving {args.directory} ({manifest.total_bytes() / 1e6:.1f} MB in {shards} shards, manifest "
        f"{manifest.digest()}) at http://{args.host}:{port}/",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    from protocol.spec import load_spec

    spec = load_spec(args.spec)
    if spec.data.url is None:
        raise ConfigError(f"{args.spec}: the run publishes no data ([data] url): its peers need a copy of data.path")
    if args.cap is not None and not args.cap > 0:
        raise ConfigError(f"--cap must be > 0 GB, got {args.cap}")
    from peer.task.tokens import open_data

    directory, manifest, fetcher = open_data(spec, args.data_dir)
    assert fetcher is not None  # data.url is set
    entries = [*manifest.validation, *manifest.train]
    total = sum(manifest.shard_bytes(e) for e in entries)
    if args.cap is not None:
        kept, budget = [], int(args.cap * 1e9)
        for entry in entries:
            if manifest.shard_bytes(entry) > budget:
                break
            budget -= manifest.shard_bytes(entry)
            kept.append(entry)
        entries, total = kept, sum(manifest.shard_bytes(e) for e in kept)
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="data", disable=args.no_progress) as bar:
        try:
            for entry in entries:
                fetcher.shard(manifest, entry)
                bar.update(manifest.shard_bytes(entry))
        finally:
            fetcher.close()
    print(f"{len(entries)} shards ({total / 1e6:.1f} MB) of manifest {manifest.digest()} verified in {directory}")
    print(f"fetched {fetcher.fetched_bytes / 1e6:.1f} MB; the rest was here already")
    return 0
