"""Who ignores Ctrl-C: the averager's process, never the peer that starts it.

A Ctrl-C at a terminal reaches the whole process group: the peer (which finishes its round,
says it leaves and stops its children in order) and hivemind's averager process, which must
not die under it mid-round. hivemind makes the child ignore SIGINT by setting SIGINT to ignored
in the *starting* process before it forks, and leaves it so while the averager gets ready
(``DecentralizedAverager.run_in_background``): seconds in which a Ctrl-C or a supervisor's
SIGINT to the peer is dropped, and the peer trains on as if never asked to stop. (A child of a
background job inherits SIGINT ignored until the peer installs its handler: the same loss, the
one that wedged the soak's harness.) ``OwnSignals`` moves the ignoring into the child
(its ``run``, first thing) and starts it without touching the parent's handler.
"""

from __future__ import annotations

import signal
from typing import Any

from engine.process_memory import limit_malloc_arenas

__all__ = ["OwnSignals"]


class OwnSignals:
    """Mixed in before hivemind's ``DecentralizedAverager`` (an ``mp.Process``)."""

    def run(self) -> None:
        """The averager process: ignore SIGINT (its parent decides when it stops), then serve."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        limit_malloc_arenas()  # inherited from a peer that capped them; here for any other parent
        super().run()  # type: ignore[misc]

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the averager process (and wait until it is ready), the caller's SIGINT handler
        left as it is."""
        process: Any = self
        process.start()
        if await_ready:
            process.wait_until_ready(timeout)
