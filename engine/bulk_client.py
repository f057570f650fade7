"""This member's bulk links (``engine.bulk_channel``): dialled to other members' listeners or
accepted by its own, one per pair, kept between rounds.

``BulkPool.open(peer)`` returns the link with ``peer``, or None where there is none (yet): the
caller then uses the libp2p stream, as before. One link per pair carries every call between the
two at once, both ways (``engine.bulk_link``), so a round of 256 holds 255 at a peer, and a small
router buffer sees one flow's opening burst per pair, as libp2p's one connection per pair. A
kept link costs nothing. Of two members that both reduce (each sends parts to the other), the one
whose ID sorts first dials and the other waits ``QUICK_S`` for that link (``theirs``); one that
waited in vain dials itself, at once from then on. Two links made at once become one: both ends
keep the same one (``BulkPool._register``).
A new link costs a ticket over libp2p (one round trip, and the libp2p dial if there is no
connection yet), the TCP and TLS handshakes (two) and the token's answer (one); a call waits
``QUICK_S`` for it, and past that takes libp2p while the dial goes on for the next round. So a
port a firewall drops, or handshakes that lose packets on a saturated link, cost a round at most
``QUICK_S`` once. A peer that could not be reached directly (it does not listen, its libp2p
connection is relayed, the dial or the handshake failed) is not tried again for ``NO_PATH_S``.

Nothing here cancels a ticket's call early: cancelled while it dials, the libp2p daemon marks the
peer as failed and refuses to dial it for a while (its dial backoff), and the libp2p stream the
sender then falls back to fails too. A 4-host benchmark on saturated 50 Mbit/s links lost
reducers that way with a 5 s deadline on the ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from hivemind.p2p import PeerID

from engine.bulk_frames import FrameError, Kind, keep_alive, read_frame, write_frame
from engine.bulk_link import BulkLink, Handler
from engine.bulk_reader import FrameReader, open_frames
from engine.bulk_tls import client_context, fingerprint

__all__ = ["BulkPool", "Ticket", "direct_hosts"]

logger = logging.getLogger(__name__)

DIAL_S = 60.0
"""A new connection's budget (in the background past ``QUICK_S``): the ticket, the TCP and TLS
handshakes and the token's answer; generous, see above."""
QUICK_S = 2.0
"""How long a call waits for a new connection before it takes libp2p: four round trips on a long
link, with room for a loaded machine."""
RETIRED_S = 30.0
"""A pair's second link (both ends dialled at once) is closed once it has carried nothing for
this long: both ends then use the same one."""
NO_PATH_S = 600.0
"""How long a peer that could not be reached directly (no listener, a dial or handshake that
failed) is left to libp2p; a ticket's libp2p call that failed is asked again at the next call."""
CONNECT_S = 10.0
"""One address's TCP and TLS handshakes at most (a dropped SYN is sent again after 1 s and 3 s)."""


class Ticket:
    """What a reducer answers over libp2p: where it listens, its certificate's pin, a token."""

    def __init__(self, port: int, pin: bytes, token: bytes) -> None:
        self.port, self.pin, self.token = port, pin, token


TicketCall = Callable[[PeerID], Awaitable[Ticket | None]]
HostsCall = Callable[[PeerID], Awaitable[list[str]]]


def direct_hosts(addrs: Iterable[Any]) -> list[str]:
    """The IP addresses among libp2p multiaddrs that reach a peer directly (``/ip4/…/tcp/…`` or
    ``/ip6/…``), in their order; relayed ones (``/p2p-circuit``) are none."""
    hosts: list[str] = []
    for addr in addrs:
        parts = str(addr).split("/")
        if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        if parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


class _NoTicket(Exception):
    """The ticket's libp2p call failed (a dial that failed or is backing off, a reset stream):
    unlike an answer without a ticket or a listener that cannot be reached, this says nothing
    about a direct path, so the next call asks again rather than leave the peer to libp2p for
    ``NO_PATH_S``. (A first round's ticket to a peer not yet connected failed this way in a 4-host
    ``benchmarks.wan_averaging`` run: libp2p's dial backoff, from an earlier failed dial, refused
    it, and every later round of the run then went over libp2p to that peer.)"""


class BulkPool:
    """This member's links, one per pair (``engine.bulk_link``): those it dialled and those its
    listener accepted (``adopt``), kept between calls and rounds; ``handler`` answers the calls
    the other ends make on them."""

    def __init__(
        self,
        ticket: TicketCall,
        hosts: HostsCall,
        *,
        handler: Handler | None = None,
        local_id: PeerID | None = None,
        dial_s: float = DIAL_S,
        quick_s: float = QUICK_S,
    ) -> None:
        self._ticket, self._hosts, self.dial_s, self.quick_s = ticket, hosts, dial_s, quick_s
        self.handler = handler
        self.local_id = local_id if local_id is not None else PeerID(b"")
        self._links: dict[PeerID, BulkLink] = {}
        self._arrived: dict[PeerID, asyncio.Event] = {}
        self._dialing: dict[PeerID, tuple[asyncio.Task[BulkLink | None], float]] = {}
        """Dials in progress, with the time until which a call waits for each."""
        self._no_path: dict[PeerID, float] = {}
        self._not_theirs: dict[PeerID, float] = {}
        """Peers that were to dial this one and did not: until when this end dials them itself."""
        self._retired: set[BulkLink] = set()
        self.dials = 0
        """New connections made (for tests and logs: a kept connection is not dialled again)."""
        self._context: ssl.SSLContext | None = None

    async def open(self, peer: PeerID, *, theirs: bool = False) -> BulkLink | None:
        """The link with ``peer``, kept or new (the calls of a round's fragments share one, and
        share its dial); None where there is no direct path (yet). ``theirs``: the pair's link is
        the other end's to dial (``engine.bulk_channel``): wait ``quick_s`` for it, then dial it
        from here for the next call (and from then on dial it without waiting)."""
        link = self._kept(peer)
        if link is not None:
            return link
        now = time.monotonic()
        if theirs and self._not_theirs.get(peer, 0.0) <= now and peer not in self._dialing:
            link = await self._wait_for_theirs(peer)
            if link is not None:
                return link
            self._not_theirs[peer] = time.monotonic() + NO_PATH_S
            if self._no_path.get(peer, 0.0) <= time.monotonic():
                self._start_dial(peer, wait_s=0.0)
            return None
        if self._no_path.get(peer, 0.0) > now:
            return None
        dial, until = self._dialing.get(peer) or self._start_dial(peer, wait_s=self.quick_s)
        try:
            return await asyncio.wait_for(asyncio.shield(dial), max(0.0, until - time.monotonic()))
        except TimeoutError:  # too slow for this call: the dial goes on, and the next call takes it
            return None

    def adopt(self, peer: PeerID, reader: FrameReader, writer: asyncio.StreamWriter) -> BulkLink:
        """A link ``peer`` dialled to this member's listener (past its token): this end's calls
        to ``peer`` may go over it from now on."""
        link = BulkLink(
            peer, reader, writer, dialled=False, handler=self.handler, local_id=self.local_id, on_close=self._gone
        )
        self._register(link)
        return link

    def kept(self, peer: PeerID) -> int:
        """Links with ``peer`` kept for the next call (0 or 1)."""
        return int(self._kept(peer) is not None)

    def links(self) -> int:
        """Links open, kept or retired (for tests and logs)."""
        return sum(link.alive() for link in (*self._links.values(), *self._retired))

    def close(self) -> None:
        for dial, _until in list(self._dialing.values()):
            dial.cancel()
        for link in (*self._links.values(), *self._retired):
            link.close()
        self._links.clear()
        self._retired.clear()

    def _kept(self, peer: PeerID) -> BulkLink | None:
        """The pair's link while it lives. Neither end closes one for being idle: rounds are
        minutes apart, keepalive holds its path open in NATs and firewalls and finds a dead one
        (``engine.bulk_frames.keep_alive``), and an end that closed an idle link at a round's start
        would break the calls the other end started on it at that moment; a link silent for
        ``engine.bulk_link.IDLE_S`` is dropped by its reader."""
        link = self._links.get(peer)
        if link is None:
            return None
        if link.alive():
            return link
        del self._links[peer]
        link.close()
        return None

    async def _wait_for_theirs(self, peer: PeerID) -> BulkLink | None:
        arrived = self._arrived.setdefault(peer, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrived.wait(), self.quick_s)
        return self._kept(peer)

    def _start_dial(self, peer: PeerID, wait_s: float) -> tuple[asyncio.Task[BulkLink | None], float]:
        dial = asyncio.ensure_future(self._dial_or_none(peer))
        entry = self._dialing[peer] = (dial, time.monotonic() + wait_s)
        dial.add_done_callback(lambda _: self._dialing.pop(peer, None))
        return entry

    def _register(self, link: BulkLink) -> None:
        """Keep ``link`` for its pair, or the pair's other one: two (both ends dialled at once, or a
        new one over one the other end lost) become one, the same at both ends (the newer of one
        end's, else the one dialled by the end whose ID sorts first); the other is retired."""
        peer = link.peer
        current = self._links.get(peer)
        if current is not None and current is not link and current.alive():
            if current.dialled != link.dialled:
                i_dial_first = self.local_id.to_bytes() < peer.to_bytes()
                keep, drop = (current, link) if current.dialled == i_dial_first else (link, current)
            else:
                keep, drop = link, current
            self._retire(drop)
            link = keep
        self._links[peer] = link
        self._no_path.pop(peer, None)
        arrived = self._arrived.pop(peer, None)
        if arrived is not None:
            arrived.set()

    def _retire(self, link: BulkLink) -> None:
        """No new calls on ``link``; it is closed once it has carried nothing for ``RETIRED_S``
        (calls the other end started before it retired it too finish first)."""
        link.retired = True
        self._retired.add(link)
        asyncio.get_running_loop().call_later(RETIRED_S, self._close_if_idle, link)

    def _close_if_idle(self, link: BulkLink) -> None:
        if not link.alive():
            self._retired.discard(link)
        elif link.idle_for() >= RETIRED_S:
            self._retired.discard(link)
            link.close()
        else:
            asyncio.get_running_loop().call_later(RETIRED_S, self._close_if_idle, link)

    def _gone(self, link: BulkLink) -> None:
        self._retired.discard(link)
        if self._links.get(link.peer) is link:
            del self._links[link.peer]

    async def _dial_or_none(self, peer: PeerID) -> BulkLink | None:
        link: BulkLink | None = None
        try:
            async with asyncio.timeout(self.dial_s):
                link = await self._dial(peer)
        except _NoTicket as exc:  # libp2p could not reach the peer now: the next call asks again
            logger.info("no bulk ticket from %s (%s); its parts go over libp2p", peer, exc)
            return None
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure means: use libp2p
            logger.info("no bulk connection to %s (%s: %s); its parts go over libp2p", peer, type(exc).__name__, exc)
        if link is None:
            if self._kept(peer) is None:
                self._no_path[peer] = time.monotonic() + NO_PATH_S
            return self._kept(peer)
        self._register(link)
        return self._kept(peer)

    async def _dial(self, peer: PeerID) -> BulkLink | None:
        try:
            ticket = await self._ticket(peer)
        except Exception as exc:  # the libp2p call failed, not the reducer's answer
            raise _NoTicket(f"{type(exc).__name__}: {exc}") from exc
        if ticket is None or ticket.port == 0:
            return None
        hosts = await self._hosts(peer)
        if not hosts:
            return None
        if self._context is None:
            self._context = client_context()
        last: BaseException | None = None
        for host in hosts:
            try:
                async with asyncio.timeout(CONNECT_S):
                    reader, writer = await open_frames(host, ticket.port, ssl=self._context, server_hostname="")
            except (OSError, TimeoutError) as exc:
                last = exc
                continue
            try:
                keep_alive(writer)
                der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if der is None or fingerprint(der) != ticket.pin:
                    raise ConnectionError(
                        f"{host}:{ticket.port} presented another certificate than {peer}'s ticket pins"
                    )
                write_frame(writer, Kind.HELLO, ticket.token)
                await writer.drain()
                kind, _call, _ = await read_frame(reader, limit=0)
                if kind != Kind.HELLO:
                    raise FrameError(f"the reducer answered the token with a {kind.name} frame")
            except BaseException:
                writer.close()
                raise
            self.dials += 1
            return BulkLink(
                peer, reader, writer, dialled=True, handler=self.handler, local_id=self.local_id, on_close=self._gone
            )
        raise ConnectionError(f"no direct address of {peer} took a connection: {last}")
