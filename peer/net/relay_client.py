"""A peer's end of a relay (``relay.server``): a public port for a peer nobody can dial.

``RelayTunnel.open`` asks the relay for a port and returns it; the peer announces
``relay-host:port`` as its swarm address. Each connection the relay announces is taken on a
new outbound connection and spliced to the peer's own libp2p daemon on ``local_port``. When
the control connection drops, the tunnel opens it again (the relay keeps the port for a
minute), with a growing pause, until ``close``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass

from peer.net.hole_punch import DirectPaths, PunchError, answer
from peer.net.loop_thread import stop_loop_thread
from protocol.errors import MalformedMessageError, SwarmtrainError
from relay.splicer import splice
from relay.wire import (
    OPENING,
    Challenge,
    Granted,
    Incoming,
    Open,
    Ping,
    PunchCall,
    Refused,
    Take,
    encode,
    ping_every,
    prove,
    read_message,
)

logger = logging.getLogger(__name__)

CONNECT_S = 10.0
PING_S = 15.0
IDLE_S = 60.0
RETRY_S = (1.0, 30.0)
DEFER_S = 3.0
"""How long a relayed connection from a host this peer reaches over a punched connection waits
before it is taken (``hole_punch.DirectPaths``): the dialler's libp2p daemon dials every address
it knows at once, so the punched path finishes its handshake first and the daemon drops the
relayed dial; were that one refused instead, it would fail, and libp2p would back its address
off for the minutes when the punched path is down and the relay is the only way in."""


MAX_TAKING = 16
"""Relayed connections one tunnel is taking at once (connecting to this peer's daemon and back
to the relay): an ``Incoming`` beyond is ignored (its dialler fails and dials again). A relay
that sent hundreds at once took one task and two descriptors each, up to the process's limit."""
MAX_SPLICED = 256
"""Relayed and punched connections one tunnel carries at once (two descriptors each): an
``Incoming`` or ``PunchCall`` beyond is ignored. Each is one remote peer's libp2p connection, so
this is also the most peers that reach this one through one relay at once."""
MAX_ANSWERING = 4
"""Punches one tunnel answers at once (each up to ``hole_punch.MAX_ATTEMPTS`` connects): a
``PunchCall`` beyond is ignored (the asker's punch times out; it stays relayed)."""


_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class RelayError(SwarmtrainError):
    """The relay refused this peer, or could not be reached."""


@dataclass(frozen=True)
class RelayAddress:
    host: str
    port: int
    whose: str = "the coordinator's relay"
    """Who runs it, as the peer's network line says it."""


RELAYS_HELD = 2
"""How many relays a relayed peer holds a port on and announces at once: when one relay leaves
(its volunteer stopped, its machine vanished), the others dial the peer at the next address its
daemon announced, with no restart. libp2p's auto-relay keeps several reservations for the same reason."""


def open_several(
    relays: Sequence[RelayAddress],
    *,
    token: Callable[[], bytes],
    sign: Callable[[bytes], bytes],
    local_port: int,
    local_host: str = "127.0.0.1",
    count: int = RELAYS_HELD,
    direct: DirectPaths | None = None,
    answer_punches: bool = False,
) -> list[tuple[RelayTunnel, RelayAddress]]:
    """Tunnels holding a port on each of the first ``count`` of ``relays`` that grant one, on
    different hosts (two relays on one host fail together), with their relays, in ``relays``'s
    order; ``RelayError`` saying why each one failed when none does."""
    failures: list[str] = []
    held: list[tuple[RelayTunnel, RelayAddress]] = []
    for relay in relays:
        if len(held) == count:
            break
        if any(relay.host == other.host for _, other in held):
            continue
        tunnel = RelayTunnel(
            relay,
            token=token,
            sign=sign,
            local_port=local_port,
            local_host=local_host,
            direct=direct,
            answer_punches=answer_punches,
        )
        try:
            tunnel.open()
        except RelayError as exc:
            logger.info("%s: %s", relay.whose, exc)
            failures.append(str(exc))
            continue
        held.append((tunnel, relay))
    if not held:
        raise RelayError("; ".join(failures) if failures else "no relay to ask")
    return held


class _Carried:
    """Bytes carried both ways by connections, the running ones included (an exit line counts
    the connections still open)."""

    def __init__(self) -> None:
        self.ended = 0
        self.running: dict[int, tuple[list[int], list[int]]] = {}
        """By connection, never looked up by value: two connections' counts are often equal."""
        self._keys = itertools.count()

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[list[int], list[int]]]:
        """Counts for one connection's ``pipe_both`` while the block runs."""
        counts: tuple[list[int], list[int]] = ([0], [0])
        key = next(self._keys)
        self.running[key] = counts
        try:
            yield counts
        finally:
            del self.running[key]
            self.ended += counts[0][0] + counts[1][0]

    def total(self) -> int:
        return self.ended + sum(there[0] + back[0] for there, back in list(self.running.values()))


class RelayTunnel:
    """Holds a port on a relay and splices what arrives there to ``127.0.0.1:local_port``."""

    def __init__(
        self,
        relay: RelayAddress,
        *,
        token: Callable[[], bytes],
        sign: Callable[[bytes], bytes],
        local_port: int,
        local_host: str = "127.0.0.1",
        direct: DirectPaths | None = None,
        answer_punches: bool = False,
    ) -> None:
        self.relay, self.token, self.local_port, self.local_host = relay, token, local_port, local_host
        self.sign = sign
        """Signs with the key the token names (the relay's challenge: ``relay.wire.prove``)."""
        self.answer_punches = answer_punches
        """Whether to answer a peer's punch (``--hole-punch``); else the asker's punch times out."""
        self.direct = direct if direct is not None else DirectPaths()
        """Hosts reached over a punched connection: their relayed connections are taken ``DEFER_S`` late."""
        self.port = 0
        """The port the relay granted (0 before ``open``)."""
        self.connections = 0
        self.punched = 0
        """Direct connections opened with peers that asked for a punch (``peer.net.hole_punch``)."""
        self._relayed: _Carried = _Carried()
        self._direct: _Carried = _Carried()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="relay-tunnel")
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        """Running takes, splices and punches: held here, since the loop keeps only weak
        references to tasks."""
        self._holding: concurrent.futures.Future[None] | None = None
        self._taking = self._spliced = self._answering = 0
        """Relayed connections being taken and carried, punches being answered (the loop's thread only)."""
        self.ignored = 0
        """``Incoming`` and ``PunchCall`` messages ignored over the caps."""
        self.down_since: float | None = None
        """``time.monotonic()`` when the control connection ended and has not opened again since
        (None: it is open); ``peer.net.relay_keeper`` finds new relays when every tunnel's is old."""

    @property
    def bytes_relayed(self) -> int:
        """Bytes the relayed connections carried both ways, those still running included."""
        return self._relayed.total()

    @property
    def bytes_punched(self) -> int:
        """Bytes the punched connections this peer answered carried both ways, running ones included."""
        return self._direct.total()

    def open(self) -> int:
        """Get a port from the relay (raises ``RelayError`` saying why not) and keep it."""
        self._thread.start()
        try:
            first = asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result(timeout=CONNECT_S + 5)
        except RelayError:
            self.close()
            raise
        self.port = first[2]
        self._holding = asyncio.run_coroutine_threadsafe(self._hold(first), self._loop)
        return self.port

    def use_token(self, token: bytes) -> None:
        """Open the control connection again with ``token`` from now on (a renewed access token:
        the relay refuses an expired one)."""
        self.token = lambda: token

    def close(self) -> None:
        """Drop the port and every relayed connection; idempotent."""
        self._closed = True
        stop_loop_thread(self._loop, self._thread, "relay tunnel")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
        where = f"{self.relay.host}:{self.relay.port}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.relay.host, self.relay.port), CONNECT_S
            )
            token = self.token()
            writer.write(encode(Open(token)))
            answer = await asyncio.wait_for(read_message(reader), CONNECT_S)
            if isinstance(answer, Challenge):  # proof that this peer holds the token's key
                writer.write(encode(prove(answer, OPENING, token, self.sign)))
                answer = await asyncio.wait_for(read_message(reader), CONNECT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, MalformedMessageError) as exc:
            raise RelayError(f"relay {where}: {exc or type(exc).__name__}") from exc
        if isinstance(answer, Refused):
            writer.close()
            raise RelayError(f"relay {where} refused this peer: {answer.reason}")
        if not isinstance(answer, Granted):
            writer.close()
            raise RelayError(f"relay {where} answered {type(answer).__name__} instead of a port")
        return reader, writer, answer.port

    async def _hold(self, first: tuple[asyncio.StreamReader, asyncio.StreamWriter, int]) -> None:
        control: tuple[asyncio.StreamReader, asyncio.StreamWriter, int] | None = first
        pause = RETRY_S[0]
        while not self._closed:
            if control is None:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_S[1])
                try:
                    control = await self._connect()
                except RelayError as exc:
                    logger.warning("relay tunnel: %s (retrying in %.0f s)", exc, pause)
                    continue
                self.down_since = None
                if control[2] != self.port:
                    logger.warning(
                        "the relay granted port %d instead of %d: peers dialling the old one fail",
                        control[2],
                        self.port,
                    )
                pause = RETRY_S[0]
            await self._serve(control[0], control[1])
            control = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pinger = asyncio.ensure_future(ping_every(writer, PING_S))
        try:
            while True:
                message = await asyncio.wait_for(read_message(reader), IDLE_S)
                if isinstance(message, PunchCall) and not self.answer_punches:
                    continue
                if isinstance(message, Incoming):
                    if self._taking >= MAX_TAKING or self._carrying() >= MAX_SPLICED:
                        self._ignore(message)
                        continue
                    self._taking += 1
                    self._run(self._take(message.conn_id, DEFER_S if message.host in self.direct else 0.0))
                elif isinstance(message, PunchCall):
                    if self._answering >= MAX_ANSWERING or self._carrying() >= MAX_SPLICED:
                        self._ignore(message)
                        continue
                    self._answering += 1
                    self._run(self._answer(message))
                elif not isinstance(message, Ping):
                    raise MalformedMessageError(f"relay sent {type(message).__name__} on the control connection")
        except (MalformedMessageError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            if not self._closed:
                logger.warning(
                    "relay tunnel: the control connection ended (%s): opening it again", exc or type(exc).__name__
                )
        finally:
            pinger.cancel()
            writer.close()

    def _carrying(self) -> int:
        """Connections carried and on their way to be (taken, punched back)."""
        return self._taking + self._answering + self._spliced

    def _run(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ignore(self, message: Incoming | PunchCall) -> None:
        self.ignored += 1
        if self.ignored == 1 or self.ignored % 1000 == 0:
            logger.warning(
                "relay tunnel: relay %s:%d sent more %s than this peer takes at once (%d ignored so far)",
                self.relay.host,
                self.relay.port,
                "connections" if isinstance(message, Incoming) else "punch calls",
                self.ignored,
            )

    async def _take(self, conn_id: int, defer: float) -> None:
        """Take relayed connection ``conn_id`` (counted in ``_taking`` by the caller) and carry it."""
        try:
            connected = await self._connect_both(conn_id, defer)
        finally:
            self._taking -= 1
        if connected is None:
            return
        relayed, local = connected
        self.connections += 1
        self._spliced += 1
        try:
            with self._relayed.counting() as counts:
                await splice(relayed, local, counts)
        finally:
            self._spliced -= 1

    async def _connect_both(self, conn_id: int, defer: float) -> tuple[_Stream, _Stream] | None:
        """This peer's daemon and the relay's side of ``conn_id``, connected (None: one failed)."""
        if defer:
            logger.debug("relay tunnel: a relayed connection from a punched host waits %.1f s", defer)
            await asyncio.sleep(defer)
        local = await self._to_daemon("relay tunnel")
        if local is None:
            return None
        try:
            relayed = await asyncio.wait_for(asyncio.open_connection(self.relay.host, self.relay.port), CONNECT_S)
            relayed[1].write(encode(Take(conn_id)))
        except (OSError, TimeoutError) as exc:
            logger.info("relay tunnel: could not take a connection: %s", exc)
            local[1].close()
            return None
        return relayed, local

    async def _to_daemon(self, what: str) -> _Stream | None:
        """A connection to this peer's own daemon, to splice a relayed or punched one to (None,
        logged as ``what``'s, when the daemon does not answer)."""
        try:
            return await asyncio.wait_for(asyncio.open_connection(self.local_host, self.local_port), CONNECT_S)
        except (OSError, TimeoutError) as exc:
            logger.warning("%s: this peer's daemon on port %d did not answer: %s", what, self.local_port, exc)
            return None

    async def _answer(self, call: PunchCall) -> None:
        """A peer that reached this one at the relay asks for a direct connection (``call``,
        counted in ``_answering`` by the caller until it connects or fails): punch it and splice
        it to this peer's daemon, as a relayed connection is (the asker's daemon dials through
        it, and the libp2p session checks who is at each end)."""
        try:
            connected = await self._punch_back(call)
        finally:
            self._answering -= 1
        if connected is None:
            return
        direct, local = connected
        self.punched += 1
        self._spliced += 1
        logger.info("hole punch: a direct connection from %s:%d", call.host, call.port)
        try:
            with self.direct.held(call.host), self._direct.counting() as counts:
                await splice(direct, local, counts)
        finally:
            self._spliced -= 1

    async def _punch_back(self, call: PunchCall) -> tuple[_Stream, _Stream] | None:
        """The punched connection to ``call``'s asker and one to this peer's daemon (None: failed)."""
        try:
            sock = await answer((self.relay.host, self.relay.port), call.punch_id, call.host)
        except (PunchError, OSError, ValueError) as exc:
            logger.info("hole punch asked by %s:%d failed: %s", call.host, call.port, exc)
            return None
        try:
            direct = await asyncio.open_connection(sock=sock)
        except OSError as exc:
            sock.close()
            logger.info("hole punch asked by %s:%d: %s", call.host, call.port, exc)
            return None
        local = await self._to_daemon("hole punch")
        if local is None:
            direct[1].close()
            return None
        return direct, local
