"""A `swarmtrain` whose machine is lost while it lands a round, for tests: it runs like any
peer until its group's all-reduce of round ``ROUND`` returned, and then, as the landing begins,
SIGKILLs its whole process group (the peer, its averager, its p2p daemon): a spot instance
reclaimed at the worst moment.

    python -m tests.integration.dies_landing ROUND peer ARGS...
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def install(round_: int) -> None:
    """Patch this process's ``Landing.apply`` to kill the process group as it begins to land
    the round that becomes ``round_``."""
    from peer.round.landing import Landing

    original = Landing.apply

    def apply(self: Landing, flight: Any, result: Any) -> Any:
        if result is not None and self.local.state.round + 1 == round_:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return original(self, flight, result)

    Landing.apply = apply  # type: ignore[method-assign]


def main() -> int:
    if len(sys.argv) < 2 or not sys.argv[1].isdigit():
        print("usage: python -m tests.integration.dies_landing ROUND peer ARGS...", file=sys.stderr)
        return 2
    install(int(sys.argv[1]))
    from swarmtrain.cli import main as swarmtrain_main

    return swarmtrain_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
