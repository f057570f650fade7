"""A `swarmtrain` that runs a hostile peer for tests: it trains like any peer and changes only
what it sends to the swarm (issue #14's attacks).

    python -m tests.integration.attacker ATTACK peer ARGS...

ATTACK is one of ``ATTACKS``: ``x100`` (its pseudo-gradient scaled by 100), ``sign-flip`` (negated),
``garbage`` (random values, finite, a thousand times a typical norm), ``samples`` (averaging
weight and gathered sample count of 1e15, a self-reported sample count nobody can check inside
the all-reduce), ``lying-reducer`` (it sends honestly, but as a reducer returns its average
shifted by a tenth of a typical value's size, the same bytes to every member: their states
agree, robust averaging never sees it; the design's known gaps had it undetected).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

ATTACKS = ("x100", "sign-flip", "garbage", "samples", "lying-reducer")
SHIFT = 0.1
HUGE = 10**15


def install(attack: str) -> None:
    """Patch this process's ``Swarm.start_round`` (or, for ``lying-reducer``, the reducer's one
    encoding of each averaged part, in the averager process it forks) to carry out ``attack``
    on every round."""
    if attack == "lying-reducer":
        _lie_as_reducer()
        return
    from peer.swarm.swarm import Swarm
    from protocol.gathered import Gathered

    original = Swarm.start_round

    def start_round(
        self: Swarm,
        *,
        weight: float,
        gather: Gathered,
        timeout: float | None = None,
        window: float | None = None,
        joining: bool = False,
    ) -> Any:
        if attack in ("x100", "sign-flip"):
            with self.outbox() as out:
                out.mul_(100.0 if attack == "x100" else -1.0)
        elif attack == "garbage":
            with self.outbox() as out:
                scale = 1e3 * float(out.norm()) / max(out.numel(), 1) ** 0.5
                out.normal_().mul_(scale)
        elif attack == "samples":
            weight, gather = float(HUGE), dataclasses.replace(gather, samples=HUGE)
        return original(self, weight=weight, gather=gather, timeout=timeout, window=window, joining=joining)

    Swarm.start_round = start_round  # type: ignore[method-assign]


def _lie_as_reducer() -> None:
    import torch

    from engine.allreduce import CodecCompression

    honest = CodecCompression.compress_average

    def compress_average(self: CodecCompression, tensor: torch.Tensor, dither: torch.Tensor) -> Any:
        typical = float(tensor.abs().mean())
        return honest(self, tensor + SHIFT * typical, dither)

    CodecCompression.compress_average = compress_average  # type: ignore[method-assign]


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: python -m tests.integration.attacker {{{','.join(ATTACKS)}}} peer ARGS...", file=sys.stderr)
        return 2
    install(sys.argv[1])
    from swarmtrain.cli import main as swarmtrain_main

    return swarmtrain_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
