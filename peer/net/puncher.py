"""Direct paths to relayed peers: this peer's connections that run through a relay's port are
replaced, one by one, by hole-punched ones (``peer.net.hole_punch``), so that averaging traffic
stops crossing the relay's host.

Every ``CHECK_S`` the puncher lists the connections of this peer's libp2p daemon. One whose
remote address is a port on a relay this peer knows (``relay-host:port``, not the relay's
control port) was dialled by this peer to a peer that relay serves: the puncher asks that
relay for a punch to the port. With a direct socket in hand it waits until no averaging round
is in flight here, then has its daemon drop its connections to that peer and dial it again at
a local port spliced to the socket. The daemon dials every address it knows for the peer, the
relay's too, and keeps the first that connects: the tunnels take a relayed connection from a
host reached directly only late (``hole_punch.DirectPaths``), so the punched one wins. The libp2p
session authenticates the peer at the other end, and both daemons use that one connection from
then on, both ways. The side that was dialled through its relay (it sees the connection come
from its own tunnel) leaves the asking to the dialler. A failed punch is asked again
``RETRY_S`` later, at most ``MAX_TRIES`` times in a row; when a punched connection ends, libp2p
dials the relay port again and the puncher asks again. IPv4 only (the punch's sockets are).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from peer.net.hole_punch import DirectPaths, NotRelayed, PunchError, punch
from peer.net.loop_thread import cancel_other_tasks, stop_loop_thread
from relay.splicer import splice

logger = logging.getLogger(__name__)

CHECK_S = 5.0
RETRY_S = 60.0
MAX_TRIES = 3
QUIET_WAIT_S = 120.0
"""How long a punched socket waits for a moment with no round in flight before it is dropped."""
DIAL_S = 20.0
AT_ONCE = 4
"""Punches under way at once (each holds a socket and, briefly, the relay's attention)."""
SWITCH_TRIES = 5


@dataclass
class PunchStats:
    asked: int = 0
    punched: int = 0
    """Punched connections this peer asked for and got, since start."""
    failed: int = 0
    bytes_direct: int = 0
    """Bytes carried both ways by the punched connections this peer asked for."""
    tries: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per libp2p peer id: (tries, monotonic time of the last)."""


def relay_target(maddr: str, relays: Mapping[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...], int] | None:
    """(relay host, the control ports of the relays on it, the port) when ``maddr`` is a port
    on a host in ``relays`` (host → control ports) other than a control port, else None."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or not parts[3].isdigit():
        return None
    host, port = parts[1], int(parts[3])
    controls = relays.get(host)
    if not controls or port in controls:
        return None
    return host, tuple(controls), port


def relays_by_ip(listed: Sequence[tuple[str, int]]) -> dict[str, tuple[int, ...]]:
    """The relays a peer was told of (host, control port), by IP address: the daemon's
    connections name IPs, and one machine may run several peers, each with a relay. A name
    that does not resolve is left out (logged)."""
    relays: dict[str, list[int]] = {}
    for host, control in listed:
        try:
            ip = socket.gethostbyname(host)
        except OSError as exc:
            logger.info("puncher: relay host %s does not resolve (%s): no punches through it", host, exc)
            continue
        if control not in relays.setdefault(ip, []):
            relays[ip].append(control)
    return {ip: tuple(controls) for ip, controls in relays.items()}


class Puncher:
    """Runs on its own thread and event loop (``start``/``close``)."""

    def __init__(
        self,
        dht: Any,
        *,
        relays: Mapping[str, tuple[int, ...]],
        token: Callable[[], bytes],
        sign: Callable[[bytes], bytes],
        quiet: Callable[[], bool],
        direct: DirectPaths,
        check_s: float = CHECK_S,
    ) -> None:
        self.dht, self.relays, self.token, self.quiet, self.check_s = dht, dict(relays), token, quiet, check_s
        self.sign = sign
        """Signs with the key the token names (a relay's challenge of a punch)."""
        """Relays by IP address (the daemon's connections name IPs) → their control ports."""
        self.direct = direct
        """Shared with this peer's relay tunnels: they take a relayed connection from a host late
        while a punched connection to it lives (else the daemon's dial to the peer's relay
        address races the punched one, and wins as often)."""
        self.stats = PunchStats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="puncher")
        self._running: concurrent.futures.Future[None] | None = None
        self._splices: set[asyncio.Task[None]] = set()
        self._p2p: Any = None
        """The replica of the DHT's P2P this thread talks to its daemon through."""
        self._rebind = False
        """Set by ``moved``: the next check replicates the new DHT node's P2P first."""

    def use_token(self, token: bytes) -> None:
        """A renewed access token (relays refuse an expired one)."""
        self.token = lambda: token

    def describe(self) -> str:
        """What it did, for the peer's line at exit."""
        stats = self.stats
        return (
            f"asked {stats.asked}, {stats.punched} direct, {stats.failed} failed "
            f"(carried {stats.bytes_direct:,} bytes directly)"
        )

    def start(self) -> None:
        self._thread.start()
        self._running = asyncio.run_coroutine_threadsafe(self._run(), self._loop)

    def close(self) -> None:
        if self._running is not None:
            self._running.cancel()
        stop_loop_thread(self._loop, self._thread, "puncher", self._cancel_all)

    async def _cancel_all(self) -> None:
        await cancel_other_tasks()
        if self._p2p is not None:  # the replica's client socket, not the daemon
            await self._p2p.shutdown()

    def moved(self, dht: Any) -> None:
        """The swarm restarted its DHT node (``Swarm.move_to``): talk to the new daemon from the
        next check on."""
        self.dht = dht
        self._rebind = True

    async def _run(self) -> None:
        p2p = self._p2p = await self.dht.replicate_p2p()
        while True:
            await asyncio.sleep(self.check_s)
            if self._rebind:
                self._rebind = False
                with contextlib.suppress(Exception):  # the old daemon is gone already
                    await p2p.shutdown()
                p2p = self._p2p = await self.dht.replicate_p2p()
            try:
                await self._check(p2p)
            except Exception:
                logger.warning("puncher: a check failed", exc_info=True)

    async def _check(self, p2p: Any) -> None:
        try:
            peers = await p2p.list_peers()
        except Exception as exc:  # noqa: BLE001 - the daemon is going away: try again later
            logger.debug("puncher: could not list connections: %s", exc)
            return
        due = []
        for info in peers:
            targets = [relay_target(str(maddr), self.relays) for maddr in info.addrs]
            target = next((t for t in targets if t is not None), None)
            if target is not None and self._due(str(info.peer_id)):
                due.append(self._punch_and_switch(p2p, info.peer_id, target))
        for start in range(0, len(due), AT_ONCE):
            await asyncio.gather(*due[start : start + AT_ONCE])

    def _due(self, peer: str) -> bool:
        tries, last = self.stats.tries.get(peer, (0, -RETRY_S))
        return tries < MAX_TRIES and time.monotonic() - last >= RETRY_S

    async def _quiet(self) -> None:
        """Until no round is in flight here (``PunchError`` after ``QUIET_WAIT_S``): the answering
        side hands its socket to its daemon at once, which drops it unless the dial comes soon."""
        end = time.monotonic() + QUIET_WAIT_S
        while not self.quiet():
            if time.monotonic() > end:
                raise PunchError(f"no moment without a round in flight in {QUIET_WAIT_S:.0f} s")
            await asyncio.sleep(0.1)

    async def _punch_and_switch(self, p2p: Any, peer_id: Any, target: tuple[str, tuple[int, ...], int]) -> None:
        host, controls, port = target
        peer = str(peer_id)
        tries, _ = self.stats.tries.get(peer, (0, 0.0))
        self.stats.tries[peer] = (tries + 1, time.monotonic())
        try:
            await self._quiet()
            sock = await self._punch(host, controls, port)
        except NotRelayed:
            self.stats.tries[peer] = (MAX_TRIES, time.monotonic())  # a direct peer on a relay's host
            return
        except (PunchError, OSError, ValueError) as exc:
            self.stats.asked += 1
            self.stats.failed += 1
            logger.info("hole punch to %s at %s:%d failed: %s", peer, host, port, exc)
            return
        self.stats.asked += 1
        try:
            await self._switch(p2p, peer_id, sock)
        except Exception as exc:  # noqa: BLE001 - the relayed path stays; libp2p redials it
            self.stats.failed += 1
            logger.info("hole punch to %s: could not move the connection onto it: %s", peer, exc)
            return
        self.stats.punched += 1
        self.stats.tries[peer] = (0, time.monotonic())  # a punched connection that ends is asked again
        logger.info("hole punch: a direct connection to %s (it was reached at %s:%d)", peer, host, port)

    async def _punch(self, host: str, controls: tuple[int, ...], port: int) -> socket.socket:
        """A punch to ``port`` through whichever relay on ``host`` holds it (several peers on one
        machine each run a relay); ``NotRelayed`` when none does."""
        for control in controls[:-1]:
            try:
                return await punch((host, control), token=self.token(), sign=self.sign, port=port)
            except NotRelayed:
                continue
        return await punch((host, controls[-1]), token=self.token(), sign=self.sign, port=port)

    async def _switch(self, p2p: Any, peer_id: Any, sock: socket.socket) -> None:
        """Have the daemon reach ``peer_id`` over ``sock`` only: a success once the daemon's
        libp2p session over it is up."""
        host = str(sock.getpeername()[0])
        try:
            direct = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            raise
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = self._loop.create_future()

        async def on_dial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if accepted.done():
                writer.close()
            else:
                accepted.set_result((reader, writer))

        holding = contextlib.ExitStack()
        server: asyncio.Server | None = None
        try:
            server = await asyncio.start_server(on_dial, "127.0.0.1", 0)
            local = server.sockets[0].getsockname()[1]
            holding.enter_context(self.direct.held(host))
            daemon, dial = await self._redial(p2p, peer_id, local, accepted)
            task = asyncio.ensure_future(self._splice(direct, daemon, holding))
            self._splices.add(task)
            task.add_done_callback(self._splices.discard)
        except BaseException:
            holding.close()
            direct[1].close()
            raise
        finally:
            if server is not None:
                server.close()
        try:  # the session runs over the splice: its handshake must pass through it
            await asyncio.wait_for(asyncio.shield(dial), DIAL_S)
        except Exception as exc:
            task.cancel()
            raise PunchError(
                f"the daemon's session over the punched socket failed: {exc or type(exc).__name__}"
            ) from exc

    async def _redial(
        self,
        p2p: Any,
        peer_id: Any,
        local: int,
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], asyncio.Future[Any]]:
        """Drop the daemon's connections to ``peer_id`` and have it dial ``127.0.0.1:local``:
        the daemon's end of the splice and the dial (still running: its handshake needs the
        splice). The daemon's ``connect`` does nothing while any connection to the peer is
        open, and one may open again between the two calls (the peer's own dial, a DHT request
        here): then drop it and dial again, up to ``SWITCH_TRIES`` times."""
        from hivemind.utils.multiaddr import Multiaddr

        target = [Multiaddr(f"/ip4/127.0.0.1/tcp/{local}")]
        for _ in range(SWITCH_TRIES):
            await p2p._client.disconnect(peer_id)
            dial = asyncio.ensure_future(p2p._client.connect(peer_id, target))
            dial.add_done_callback(_consume)
            done, _ = await asyncio.wait({dial, accepted}, timeout=DIAL_S, return_when=asyncio.FIRST_COMPLETED)
            if accepted.done():
                return accepted.result(), dial
            if not done:
                raise PunchError(f"the daemon did not dial the punched socket in {DIAL_S:.0f} s")
            try:  # connect returned first: it dialled (the accept is on its way) or found a connection
                return await asyncio.wait_for(asyncio.shield(accepted), 0.5), dial
            except TimeoutError:
                continue
        raise PunchError(f"another connection to the peer kept opening ({SWITCH_TRIES} tries)")

    async def _splice(
        self,
        direct: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        daemon: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        holding: contextlib.ExitStack,
    ) -> None:
        counts: tuple[list[int], list[int]] = ([0], [0])
        try:
            with holding:
                await splice(direct, daemon, counts)
        finally:
            self.stats.bytes_direct += counts[0][0] + counts[1][0]


def _consume(future: asyncio.Future[Any]) -> None:
    """A ``connect`` whose outcome nobody awaits: its error is only logged."""
    if not future.cancelled() and future.exception() is not None:
        logger.debug("puncher: the daemon's connect failed: %s", future.exception())
