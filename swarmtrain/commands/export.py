"""``swarmtrain export SOURCE --out DIR``: a checkpoint as a Hugging Face model directory.

SOURCE is a checkpoint file, a peer's ``--checkpoint-dir``, a coordinator's archive or its
``--state-dir`` (the archive inside); the newest checkpoint that verifies is exported. The
checkpoint carries its run spec, so nothing else is needed (``--spec`` for checkpoints written
before they did); a ``causal_lm`` run's tokenizer comes from the spec's data path or
``--tokenizer``. Heavy imports (torch, transformers) happen only when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)",
        description="Write the newest verified checkpoint of SOURCE as a model directory that "
        "transformers.AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load: the demo's "
        "byte model as a GPT-2 of 256 byte tokens, a causal_lm run as its own architecture with the run's "
        "tokenizer.",
    )
    parser.add_argument(
        "source",
        type=Path,
        metavar="SOURCE",
        help="a checkpoint file, a peer's --checkpoint-dir, or a coordinator's --state-dir or archive",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="new or empty directory to write")
    parser.add_argument(
        "--spec",
        type=Path,
        default=None,
        metavar="FILE",
        help="the run spec (default: the one the checkpoint carries; needed for older checkpoints)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="causal_lm runs: directory of the run's tokenizer.json (default: the spec's data.path)",
    )
    parser.set_defaults(run=run)


def source_directory(source: Path) -> Path:
    """Where SOURCE's checkpoints are: a coordinator's state directory holds them in ``archive``."""
    if source.is_dir() and (source / "archive").is_dir() and not any(source.glob("round-*.pt")):
        return source / "archive"
    return source


def run(args: argparse.Namespace) -> int:
    from engine.checkpoint import checkpoint_spec, read_checkpoint
    from peer.export import export_model
    from protocol.spec import load_spec

    if not args.source.exists():
        raise ConfigError(f"{args.source}: no such file or directory")
    spec = load_spec(args.spec) if args.spec is not None else None
    record = read_checkpoint(source_directory(args.source), spec_digest=spec.digest() if spec else None)
    spec = spec if spec is not None else checkpoint_spec(record)
    if spec is None:  # read_checkpoint refuses a checkpoint without its spec when none is given
        raise ConfigError(f"{args.source}: carries no run spec: pass the run's --spec")
    exported = export_model(
        spec,
        record["params"],
        args.out,
        round_=int(record["round"]),
        state_digest=str(record["state_digest"]),
        tokenizer_dir=args.tokenizer,
    )
    print(
        f"exported round {exported.round} of {exported.run} ({exported.parameters:,} parameters, "
        f"{exported.architecture}) to {args.out}"
    )
    print(f"load it: transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0
