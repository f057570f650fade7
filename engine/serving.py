"""A round's result as soon as this peer holds it; its reducer's serving ends in the background.

A reducer's handler for a sender ends only once that sender holds every averaged part and has
ended its request stream (``engine.allreduce``: a stream the reducer closed first could be
reset while the last parts were still buffered on the way). Waiting for every sender's end
before this peer's own round returned added that end's trip back to every round: about one
round trip (with it gone, 4 hosts average at 97-99% of plain TCP's speed on 40 and 120 ms links,
docs/benchmarks.md "The all-reduce at the shipped defaults against plain TCP"). The round now returns once this peer's own averaged parts are
in; the wait for its senders goes on beside the next round's work, and an averager that shuts
down (the peer leaves, or moves to a new relay) first lets it finish, at most ``DRAIN_S``, so a
leaving peer never cuts the last averaged parts of the members it served (they would miss the
round). Mixed into ``engine.averager.ExactAverager`` (before hivemind's ``DecentralizedAverager``,
whose shutdown calls ``_drain_serving`` first).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["DRAIN_S", "SHUTDOWN_S", "BackgroundServingMixin"]

logger = logging.getLogger(__name__)

DRAIN_S = 30.0
"""The longest an averager's shutdown waits for its senders to take their last averaged parts."""
SHUTDOWN_S = 5.0 + DRAIN_S
"""hivemind's grace before it terminates the averager's process (its default 5 s, plus the drain)."""


class BackgroundServingMixin:
    """Serving that outlives the round; see the module."""

    async def _serve_in_background(self, runner: Any) -> None:
        """Let ``runner``'s reducer finish serving its senders without holding up the round."""
        timeout = float(runner.reducer_timeout or 60.0)

        async def serve() -> None:
            if not await runner.wait_until_served(timeout=timeout):
                logger.info("all-reduce: some members had not taken their last averaged parts from this peer")
            runner.served_all()  # its encoded averages go (the runner stays for the round's audits)

        task = asyncio.ensure_future(serve())
        serving: set[asyncio.Task[None]] = self.__dict__.setdefault("_background_serving", set())
        serving.add(task)
        task.add_done_callback(serving.discard)

    async def _drain_serving(self) -> None:
        """Wait, at most ``DRAIN_S``, for the senders of every round this reducer served to take
        their last averaged parts (``ExactAverager._shutdown`` calls this first)."""
        serving: set[asyncio.Task[None]] = set(self.__dict__.get("_background_serving", ()))
        if serving:
            _, late = await asyncio.wait(serving, timeout=DRAIN_S)
            if late:
                logger.warning("shut down with %d reducers' senders still taking their last parts", len(late))
