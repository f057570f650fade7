"""Server streams that end only once their reader has closed its end.

hivemind's stream handlers run behind p2pd, which pipes each libp2p stream to a local socket.
When a handler returns, hivemind closes that socket at once; p2pd then closes the libp2p
stream and, as its read of the stream fails, resets it. A reset that reaches the reader's
daemon before it has passed on the last message drops that message (go-yamux reports the
reset rather than the buffered bytes). Measured in a 4-peer swarm (1 run in 6 of
``tests/integration/test_hostile_peers.py``'s clean run): a leader's ``BEGIN_ALLREDUCE`` to one
follower was lost that way; the leader counted the follower in its group, the follower never
took part, and the round failed for all four.

So a handler's last message is followed by a wait for the reader to close its end, which it
does as soon as it has read that message (hivemind's requesters close their stream once done):
hivemind cancels the handler when the reader's close arrives. A reader that never closes
costs one idle stream for ``CLOSE_WAIT_S``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

__all__ = ["CLOSE_WAIT_S", "until_reader_closes"]

CLOSE_WAIT_S = 15.0
"""The longest a handler waits, after its last message, for its reader to close the stream."""

T = TypeVar("T")


async def until_reader_closes(messages: AsyncIterator[T], wait_s: float = CLOSE_WAIT_S) -> AsyncIterator[T]:
    """Yield ``messages``; then wait (up to ``wait_s``) until the handler running this is
    cancelled, which hivemind does when the stream's reader closes its end."""
    async for message in messages:
        yield message
    await asyncio.sleep(wait_s)
