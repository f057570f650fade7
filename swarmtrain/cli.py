"""The ``swarmtrain`` command: parses arguments (before any heavy import) and dispatches.

Every failure a user can cause ends with exit status != 0 and one line per problem on
stderr, ``swarmtrain <command>: error: ...``; never a bare traceback.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import io
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from coordinator import cli as coordinator_cli
from engine.process_memory import limit_malloc_arenas
from peer import cli as peer_cli
from protocol.errors import SpecError, SwarmtrainError
from swarmtrain import __version__, node_launcher
from swarmtrain.commands import admin, data, demo, doctor, export, keygen, spec, status
from swarmtrain.lifetime import leave_with_parent, tie_children_to_this_process

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line and points at --help, and remembers its
    flags and subcommands (argparse keeps them private) to suggest what a misspelt flag meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: list[str] = []  # before argparse's own __init__ adds --help
        self.subcommands: list[Any] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        self.flags += [name for name in args if isinstance(name, str) and name.startswith("--")]
        return super().add_argument(*args, **kwargs)

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.subcommands.append(action)
        return action

    def command(self, name: str) -> _Parser | None:
        """The parser of subcommand ``name``."""
        for action in self.subcommands:
            found = action.choices.get(name)
            if isinstance(found, _Parser):
                return found
        return None

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> _Parser:
    parser = _Parser(
        prog="swarmtrain",
        description="Train one model together with GPU peers across the internet.",
        epilog="Run `swarmtrain COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"swarmtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    peer_cli.add_parser(commands)
    coordinator_cli.add_parser(commands)
    status.add_parser(commands)
    admin.add_parser(commands)
    demo.add_parser(commands)
    keygen.add_parser(commands)
    spec.add_parser(commands)
    data.add_parser(commands)
    export.add_parser(commands)
    doctor.add_parser(commands)
    return parser


def did_you_mean(parser: _Parser, command: str, extra: Sequence[str]) -> str:
    """``" (did you mean --x?)"`` for the first unknown flag close to one ``command`` takes."""
    sub = parser.command(command)
    if sub is None:
        return ""
    options = list(sub.flags)
    for action in sub.subcommands:  # e.g. `data prepare`: the action's own flags too
        options += [flag for choice in action.choices.values() if isinstance(choice, _Parser) for flag in choice.flags]
    for flag in extra:
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_any_arguments", False):
        command = parser.command(args.command) or parser
        command.error(f"unrecognized arguments: {' '.join(extra)}{did_you_mean(parser, args.command, extra)}")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    limit_malloc_arenas()  # before any thread starts: every thread after it shares the arenas
    _whole_lines()
    _stacks_on_request()
    _configure_logging(args.verbose)
    tie_children_to_this_process()
    leave_with_parent()
    prog = f"swarmtrain {args.command}"
    try:
        if args.command == "peer":
            ranks = peer_cli.ranks_to_launch(args)
            if ranks is not None:
                return node_launcher.launch(args.argv, ranks, rank_timeout_s=args.rank_timeout)
        return int(args.run(args))
    except SpecError as exc:
        for problem in exc.problems:
            print(f"{prog}: error: {exc.source}: {problem}", file=sys.stderr)
        return EXIT_ERROR
    except SwarmtrainError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _whole_lines() -> None:
    """Each line of output in one write, also unbuffered (PYTHONUNBUFFERED, where ``print``
    writes a line and its newline apart): peers that share a terminal or a log (the README's
    background peers) finish at the same moment and must not interleave each other's lines."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


STACKS_SIGNAL = signal.SIGUSR1
"""``kill -USR1 PID`` makes a running ``swarmtrain`` print every thread's stack to its stderr
and go on: what a process that stays silent is waiting for (the tests send it to a child that
printed nothing by its deadline, so the failure names the line it hangs on)."""


def _stacks_on_request() -> None:
    """Dump every thread's stack on ``STACKS_SIGNAL`` (faulthandler: from C, so it works while
    the interpreter is stuck in a call that holds the GIL)."""
    if sys.stderr is not None and hasattr(sys.stderr, "fileno"):
        try:
            faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
        except (ValueError, OSError, io.UnsupportedOperation):  # stderr without a descriptor
            pass


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # hivemind configures its own loggers from this variable when first imported.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", logging.getLevelName(max(level, logging.INFO)))
