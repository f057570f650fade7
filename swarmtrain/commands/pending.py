"""Role commands whose implementation has not landed yet: listed, honest, non-zero."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_ISSUES = {"coordinator": 4, "status": 4}


def add_parser(commands: Any, name: str, help_text: str) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=run, accepts_any_arguments=True)


def run(args: argparse.Namespace) -> int:
    print(
        f"swarmtrain {args.command}: error: not available in this build yet (tracked in issue #{_ISSUES[args.command]})",
        file=sys.stderr,
    )
    return 2
