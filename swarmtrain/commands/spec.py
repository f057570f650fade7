"""``swarmtrain spec check FILE...``: validate run specs and print their digests."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from protocol.errors import SpecError
from protocol.spec import load_spec


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("spec", help="work with run spec files (TOML)", description="Run spec tools.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    check = actions.add_parser(
        "check",
        help="validate spec files; print each digest, or one line per problem",
        description="Validate run spec files. Prints `FILE: ok sha256:...` per valid file; "
        "for an invalid one, one line per problem naming the field (and line).",
    )
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    check.add_argument("--json", action="store_true", help="print the validated spec(s) as JSON instead")
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            failed = True
            for problem in exc.problems:
                print(f"swarmtrain spec check: error: {exc.source}: {problem}", file=sys.stderr)
            continue
        if args.json:
            out = {"file": str(path), "digest": spec.digest(), "spec": spec.model_dump(mode="json")}
            print(json.dumps(out, indent=2, sort_keys=True))
        else:
            print(f"{path}: ok {spec.digest()}")
    return 1 if failed else 0
