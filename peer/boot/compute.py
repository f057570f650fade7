"""The spec a peer computes with: the run's, with this peer's own micro-batches, activation
checkpointing and compiled blocks (``protocol.spec.local_compute``), never the run's spec or
its digest. Light: the leader's start-up and every other rank read it."""

from __future__ import annotations

import argparse

from protocol.spec import RunSpec, local_compute


def local_compute_spec(spec: RunSpec, args: argparse.Namespace) -> RunSpec:
    """The spec this peer builds its task from: the run's, with ``--micro-batches`` and
    ``--activation-checkpointing`` applied (``protocol.spec.local_compute``)."""
    checkpointing = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    compile_blocks = None if args.compile is None else args.compile == "on"
    return local_compute(
        spec, micro_batches=args.micro_batches, checkpointing=checkpointing, compile_blocks=compile_blocks
    )
