"""``swarmtrain keygen [--out PATH] [--force]``: create an Ed25519 identity, print its id."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from protocol.identity import Identity, default_key_path


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "keygen",
        help="create an identity key file (mode 0600) and print its public id",
        description="Create an Ed25519 identity for a peer, an account or a coordinator.",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"key file to create (default: {default_key_path()})")
    parser.add_argument("--force", action="store_true", help="replace an existing key file (its identity is lost)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path: Path = args.out if args.out is not None else default_key_path()
    identity = Identity.generate()
    identity.save(path, overwrite=args.force)
    print(identity.public_key.id)
    print(f"key written to {path} (mode 0600); keep it private: it is this identity")
    return 0
