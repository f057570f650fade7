"""A round's libp2p connections, made before its parts flow, and by one end of each pair.

In a round every member sends parts to every reducer at once, so two members that share no
libp2p connection yet (two followers of one leader, in a first round) dial each other at the
same moment. p2pd dials from its listening port (TCP port reuse), so the two dials can meet as
one TCP simultaneous open: both ends then start the security handshake as its initiator, both
fail, and libp2p's dial backoff refuses every further dial between the two for seconds, the
round's parts included. In 4-host ``benchmarks.wan_averaging`` runs over libp2p alone every
pair of followers logged "all dials failed ... dial backoff" for each other and round after
round left half the vector out; an earlier failed dial (two peers' matchmaking or DHT calls to
each other) leaves the same backoff behind.

So, before the parts (``open_round_connections``): of each pair not yet connected, the member
whose ID sorts first dials; the other waits ``WAIT_S`` for that connection. A dial that fails
(backoff) waits in turn for the other's dial, which comes once the other's wait is over; a wait
that ends empty dials. Only a member that reduces is dialled by the others (every member sends
to the reducers); one that does not (a client-mode member) dials everyone itself and waits for
nobody. Connections are kept from round to round, so a round with no new member costs one
``list_peers`` call. A dial is never cancelled (a cancelled dial puts p2pd into backoff too):
one slower than ``DIAL_S`` is left to finish on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hivemind.p2p import PeerID

__all__ = ["DIAL_S", "WAIT_S", "dialled_by_them", "open_round_connections"]

logger = logging.getLogger(__name__)

WAIT_S = 3.0
"""How long a member waits for the connection of one that dials it: a TCP and a security
handshake, a few round trips, on a link that may already carry another round's parts."""
DIAL_S = 10.0
"""How long a member waits on its own dial before it goes on (the dial itself goes on)."""
POLL_S = 0.05


def dialled_by_them(me: PeerID, reducers: Iterable[PeerID], *, i_reduce: bool) -> list[PeerID]:
    """The reducers this member should not dial first: those that sort before it and send to it
    (every member sends to the reducers, so only if this member reduces)."""
    if not i_reduce:
        return []
    mine = me.to_bytes()
    return [peer for peer in reducers if peer != me and peer.to_bytes() < mine]


async def open_round_connections(
    p2p: Any,
    me: PeerID,
    reducers: Sequence[PeerID],
    *,
    i_reduce: bool,
    wait_s: float = WAIT_S,
    dial_s: float = DIAL_S,
    poll_s: float = POLL_S,
) -> list[PeerID]:
    """Connect ``p2p`` to each of ``reducers`` (``i_reduce``: whether this member reduces, so
    that the others dial it too); the reducers still not connected at the end."""
    try:
        connected = {info.peer_id for info in await p2p.list_peers()}
    except Exception as exc:  # noqa: BLE001 - the daemon did not answer: the parts dial as they always did
        logger.warning("could not list libp2p connections before the round (%s: %s)", type(exc).__name__, exc)
        return [peer for peer in dict.fromkeys(reducers) if peer != me]
    todo = [peer for peer in dict.fromkeys(reducers) if peer != me and peer not in connected]
    if not todo:
        return []
    theirs = set(dialled_by_them(me, todo, i_reduce=i_reduce))

    async def arrives(peer: PeerID, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while peer not in connected:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def dial(peer: PeerID) -> bool:
        attempt = asyncio.ensure_future(p2p._client.connect(peer, []))
        try:
            await asyncio.wait_for(asyncio.shield(attempt), dial_s)
        except Exception as exc:  # noqa: BLE001 - backoff, refused, slow: the other end may dial
            logger.info("libp2p dial to %s failed before the round: %s: %s", peer, type(exc).__name__, exc)
            attempt.add_done_callback(_quiet)
            return False
        connected.add(peer)
        return True

    async def reach(peer: PeerID) -> bool:
        if peer in theirs:
            return await arrives(peer, wait_s) or await dial(peer)
        return await dial(peer) or (i_reduce and await arrives(peer, 2 * wait_s))

    async def watch() -> None:
        while True:
            await asyncio.sleep(poll_s)
            with contextlib.suppress(Exception):  # one missed poll: the next one sees it
                connected.update(info.peer_id for info in await p2p.list_peers())

    watcher = asyncio.ensure_future(watch())
    try:
        reached = await asyncio.gather(*(reach(peer) for peer in todo))
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    missing = [peer for peer, ok in zip(todo, reached) if not ok]
    if missing:
        logger.warning("no libp2p connection to %s before the round: their parts may be left out", missing)
    return missing


def _quiet(attempt: asyncio.Future[Any]) -> None:
    """A dial left to finish on its own: its failure is already logged."""
    if not attempt.cancelled():
        attempt.exception()
