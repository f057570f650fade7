"""Which end of a pair dials the libp2p connection a round needs: the one whose peer ID sorts first.

In a round every member sends parts to every reducer at once, so two members that share no
libp2p connection yet (two followers of one leader, in a first round) dial each other at the
same moment. p2pd dials from its listening port (TCP port reuse), so the two dials can meet as
one TCP simultaneous open: both ends then start the security handshake as its initiator, both
fail, and libp2p's dial backoff refuses every further dial between the two for seconds, the
round's parts to that reducer included (seen in 4-host ``benchmarks.wan_averaging`` runs: both
members of a pair logged "all dials failed ... dial backoff" for each other, and that round left
their ranges out).

So the member whose ID sorts last waits, ``WAIT_S`` at most, for the other's connection
(``await_dials``), and only then sends; the one that sorts first dials as it sends. Only a
member that reduces is dialled by the others; one that does not (a client-mode member, a zero
share) is never waited for. Past ``WAIT_S`` (the other is late, dead or cannot dial) the member
dials anyway: at worst the old race, never a round lost to waiting. Connections are kept from
round to round, so a round with no new member pays one ``list_peers`` call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hivemind.p2p import PeerID

__all__ = ["WAIT_S", "await_dials", "dialled_by_them"]

logger = logging.getLogger(__name__)

WAIT_S = 3.0
"""How long a member waits for the connections of those that dial it: a TCP and a security
handshake, a few round trips, on a link busy with the round's first parts."""
POLL_S = 0.05


def dialled_by_them(me: PeerID, reducers: Iterable[PeerID], *, i_reduce: bool) -> list[PeerID]:
    """The reducers this member should not dial first: those that sort before it and send to it
    (every member sends to the reducers, so only if this member reduces)."""
    if not i_reduce:
        return []
    mine = me.to_bytes()
    return [peer for peer in reducers if peer != me and peer.to_bytes() < mine]


async def await_dials(
    p2p: Any, peers: Sequence[PeerID], wait_s: float = WAIT_S, poll_s: float = POLL_S
) -> list[PeerID]:
    """Wait until ``p2p`` holds a connection to each of ``peers``, ``wait_s`` at most; those that
    never came (the caller then dials them itself)."""
    waiting = set(peers)
    deadline = time.monotonic() + wait_s
    while waiting:
        waiting -= {info.peer_id for info in await p2p.list_peers()}
        if not waiting or time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll_s)
    if waiting:
        logger.info("no libp2p connection from %s within %.1f s: dialling them", sorted(map(str, waiting)), wait_s)
    return [peer for peer in peers if peer in waiting]
