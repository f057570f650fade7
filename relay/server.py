"""The relay: a public TCP port for each admitted peer that nobody can dial. The coordinator
runs one (``coordinator.server``), and so does every reachable peer that does not opt out
(``peer.net.relay_service``): a relayed peer tries the volunteers' relays the coordinator lists
before the coordinator's own, so the coordinator's uplink does not carry every relayed peer.

Measured in the NAT lab (``benchmarks/netsim.py``, hivemind 1.1.12): libp2p's circuit relay in
hivemind's p2pd resets every relayed connection after about 128 KiB each way, whatever its
``-relayDataLimit`` says, so matchmaking crosses it but no averaging part does; and its hole
punching (DCUtR) starts only once a host has a public address observed by several directly
connected peers, which a swarm of NAT'ed volunteers around one coordinator never gives. So
the relay works below libp2p: the peer's daemon is announced at ``relay-host:port`` and every
connection there is spliced to a connection the peer opened itself (``relay.wire``).
libp2p's session (TLS or noise, then yamux) runs end to end through it; the relay sees only
ciphertext and can neither read nor forge a part.

It also times hole punches (``relay.wire``: ``PunchAsk`` … ``PunchGo``): it tells a
port's holder and an admitted asker where each other's fresh socket came from, so that the two
open a direct connection and stop crossing it (``peer.net.hole_punch``).

Caps: a list of ports (one port per peer: their number is the most peers relayed at once; 0
stands for any free port, picked at the grant), a number of connections per port, a deadline
for the peer to take each connection, a number of punches waiting for an answer, a number of
control-port connections that have not said what they are (in all and per source host). A peer keeps its port for ``KEEP_S`` after its control
connection drops, so a reconnect keeps its address.
Thread-safe to start and stop; everything else runs on the relay's own event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ConfigError, MalformedMessageError, SwarmtrainError
from protocol.identity import PublicKey
from relay.splicer import splice
from relay.wire import (
    NONCE_BYTES,
    NOT_HELD,
    OPENING,
    PUNCHING,
    Challenge,
    Granted,
    Incoming,
    Open,
    Ping,
    Proof,
    PunchAnswer,
    PunchAsk,
    PunchCall,
    PunchGo,
    Refused,
    Take,
    encode,
    ping_every,
    proof_bytes,
    read_message,
)

logger = logging.getLogger(__name__)

FIRST_MESSAGE_S = 10.0
MAX_UNOPENED = 64
"""Connections to the control port that have not sent their first message yet (anyone may
open one): beyond, a new one is closed at once. The relay runs inside a volunteer's peer
process, so idle connections must not take its descriptors (1,100 did before)."""
MAX_UNOPENED_PER_SOURCE = 8
"""Of ``MAX_UNOPENED``, from one host: one stranger cannot hold every slot."""
TAKE_S = 10.0
PING_S = 15.0
IDLE_S = 60.0
KEEP_S = 60.0
MAX_CONNS_PER_PORT = 64
PUNCH_ANSWER_S = 5.0
"""How long a punch waits for the port's holder to answer from a fresh socket."""
MAX_PUNCHES = 64
"""Punches waiting for an answer at once (each holds two sockets for up to ``PUNCH_ANSWER_S``)."""
MAX_PUNCHES_PER_PEER = 4
"""Punches one peer may have waiting at once, as the asker and as the holder: an admitted peer
cannot take every slot, nor make one holder open sockets without end."""
STOP_TASKS_S = 5.0
"""At ``Relay.stop`` the connections' tasks, cancelled, have this long to end."""
MAX_RELAYS_LISTED = 8
"""Volunteers' relays a coordinator's join answer lists (``JoinResponse.relays``), and the most
a peer takes from one."""

Admit = Callable[[bytes], str]
"""Checks a peer's access token; returns its public id, raises ``ValueError`` saying why not."""


def run_token_admission(
    *,
    coordinator_key: PublicKey,
    run_digest: str,
    revoked: Callable[[], frozenset[str] | set[str]] = frozenset,
    clock: Callable[[], float] = time.time,
) -> Admit:
    """The relay's admission in a coordinator's run: a valid access token of the run (signed by
    ``coordinator_key``, not expired) whose peer is not in ``revoked()``. Holding a port grants
    nothing else: who may average is still the swarm's gate (``protocol.membership``)."""
    from protocol.tokens import decode_token, verify_token

    def admit(token: bytes) -> str:
        try:
            decoded = decode_token(token)
            verify_token(decoded, coordinator_key=coordinator_key, run_digest=run_digest, now=clock())
        except SwarmtrainError as exc:
            raise ValueError(f"not a valid access token of this run: {exc}") from exc
        if decoded.peer_key.id in revoked():
            raise ValueError("this peer's admission was revoked")
        return decoded.peer_key.id

    return admit


def parse_port_range(text: str, *, flag: str = "--relay-ports") -> range | None:
    """``FIRST-LAST`` (inclusive, 1..65535) → a range; ``none`` → None; else a ConfigError."""
    if text.strip().lower() == "none":
        return None
    first, sep, last = text.partition("-")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(f"{flag} must be FIRST-LAST (e.g. 7801-7864) or none, got {text!r}")
    low, high = int(first), int(last)
    if not 1 <= low <= high <= 65535:
        raise ConfigError(f"{flag} must be ports 1..65535 with FIRST <= LAST, got {text!r}")
    return range(low, high + 1)


@dataclass(frozen=True)
class RelayStats:
    peers: int
    """Peers holding a port now."""
    connections: int
    """Connections being spliced now."""
    bytes_relayed: int
    """Bytes carried both ways since start."""


@dataclass
class _Port:
    peer: str
    port: int
    server: asyncio.Server
    control: asyncio.StreamWriter | None = None
    pending: dict[int, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(default_factory=dict)
    active: int = 0
    released: asyncio.TimerHandle | None = None


def describe_ports(ports: Sequence[int]) -> str:
    """``7801-7864`` for a run of consecutive ports, else ``7801, 7803``; ``any 8 free ports``
    for 0s."""
    ports = list(ports)
    if ports and not any(ports):
        return f"any {len(ports)} free port{'s' if len(ports) > 1 else ''}"
    if ports and ports == list(range(ports[0], ports[0] + len(ports))):
        return f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
    return ", ".join(map(str, ports))


class Relay:
    """Serves ``relay.wire`` on ``host:control_port``, granting ports from ``ports``."""

    def __init__(self, *, host: str, control_port: int, ports: Sequence[int], admit: Admit) -> None:
        if not ports:
            raise ValueError("the relay needs at least one port to grant")
        self.host, self.control_port, self.ports, self.admit = host, control_port, list(ports), admit
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="relay")
        self._by_peer: dict[str, _Port] = {}
        self._pending: dict[int, _Port] = {}
        self._relayed = 0
        """Bytes of the splices that ended."""
        self._live: dict[int, tuple[list[int], list[int]]] = {}
        """Byte counts of the splices running now, by connection id (libp2p keeps its connections
        open for hours). Keyed, never looked up by value: two splices' counts are often equal."""
        self._server: asyncio.Server | None = None
        self._punches: dict[int, tuple[asyncio.Future[tuple[str, int]], tuple[str, int]]] = {}
        self._punching: dict[str, int] = {}
        """Punches waiting for an answer, by the asker's and the holder's public id."""
        """Punches waiting for their holder's answer: (the answer's observed address, the asker's)."""
        self.punches = 0
        """Punches both sides were told to make, since start."""
        self._unopened: dict[str, int] = {}
        self._unopened_total = 0
        """Control-port connections waiting for their first message, by source host, and in all."""
        self.turned_away = 0
        """Connections closed at once over ``MAX_UNOPENED`` or ``MAX_UNOPENED_PER_SOURCE``, since start."""

    def start(self) -> int:
        """Listen; returns the control port (the one given, or the one picked for 0)."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        return future.result(timeout=10)

    def stop(self) -> None:
        """Close the control port, release every port, end every connection's task, then the
        loop (tasks left pending would run their cleanup at exit on a closed loop: a traceback
        in every stopping peer's log)."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def stats(self) -> RelayStats:
        live = list(self._live.values())
        running = sum(a[0] + b[0] for a, b in live)
        return RelayStats(peers=len(self._by_peer), connections=len(live), bytes_relayed=self._relayed + running)

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._on_control, self.host, self.control_port)
        port: int = self._server.sockets[0].getsockname()[1]
        logger.info("relay listening on %s:%d, granting ports %s", self.host, port, describe_ports(self.ports))
        return port

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        for held in list(self._by_peer.values()):
            self._release(held)
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TASKS_S)

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection to the control port, to its end; cancelled (``stop``), it ends quietly
        (asyncio's stream callback reports a cancelled handler as an error with a traceback)."""
        try:
            await self._control(reader, writer)
        except asyncio.CancelledError:
            writer.close()

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        observed = _observed(writer)
        source = observed[0] if observed is not None else ""
        if self._unopened_total >= MAX_UNOPENED or self._unopened.get(source, 0) >= MAX_UNOPENED_PER_SOURCE:
            self.turned_away += 1
            writer.close()
            return
        self._unopened_total += 1
        self._unopened[source] = self._unopened.get(source, 0) + 1
        peer = ""
        try:
            first = await asyncio.wait_for(read_message(reader), FIRST_MESSAGE_S)
            if isinstance(first, Open | PunchAsk):
                peer = await self._proven(first.token, OPENING if isinstance(first, Open) else PUNCHING, reader, writer)
                if not peer:
                    return
        except (MalformedMessageError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            logger.info("relay: dropped a connection that did not open or take: %s", exc or type(exc).__name__)
            writer.close()
            return
        finally:
            self._unopened_total -= 1
            left = self._unopened[source] - 1
            if left:
                self._unopened[source] = left
            else:
                del self._unopened[source]
        if isinstance(first, Take):
            await self._take(first.conn_id, reader, writer)
        elif isinstance(first, Open):
            await self._serve_peer(peer, reader, writer)
        elif isinstance(first, PunchAsk):
            await self._punch_ask(first, peer, writer)
        elif isinstance(first, PunchAnswer):
            self._punch_answer(first.punch_id, writer)
        else:
            writer.close()

    async def _proven(
        self, token: bytes, purpose: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> str:
        """The public id ``token`` admits, once the connection proved it holds that id's key
        (``Challenge``, ``Proof``); "" (the connection refused and closed, nothing changed)
        otherwise. A token alone proves nothing: every admitted peer's is in the run's DHT."""
        try:
            peer = self.admit(token)
        except ValueError as exc:
            logger.info("relay: refused a %s: %s", purpose, exc)
            writer.write(encode(Refused(str(exc))))
            writer.close()
            return ""
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(encode(Challenge(nonce)))
        reply = await asyncio.wait_for(read_message(reader), FIRST_MESSAGE_S)
        if not isinstance(reply, Proof) or not _signed_by(peer, reply.signature, proof_bytes(purpose, nonce, token)):
            logger.info("relay: refused a %s with %s's token: no proof it holds that key", purpose, peer)
            writer.write(encode(Refused("no proof of the token's key: sign the relay's challenge with it")))
            writer.close()
            return ""
        return peer

    async def _serve_peer(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hold a port for ``peer`` (proven) on this control connection until it ends."""
        try:
            held = await self._grant(peer)
        except ValueError as exc:
            logger.info("relay: refused a peer: %s", exc)
            writer.write(encode(Refused(str(exc))))
            writer.close()
            return
        if held.control is not None:
            held.control.close()  # the same peer opened again: the newer connection wins
        held.control = writer
        writer.write(encode(Granted(held.port)))
        logger.info("relay: %s holds port %d", peer, held.port)
        pinger = asyncio.ensure_future(ping_every(writer, PING_S))
        try:
            while True:
                message = await asyncio.wait_for(read_message(reader), IDLE_S)
                if not isinstance(message, Ping):
                    raise MalformedMessageError(f"relay: unexpected {type(message).__name__} on a control connection")
        except (MalformedMessageError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            logger.info("relay: %s's control connection ended: %s", peer, exc or type(exc).__name__)
        finally:
            pinger.cancel()
            writer.close()
            if held.control is writer:
                held.control = None
                held.released = self._loop.call_later(KEEP_S, self._release, held)

    async def _grant(self, peer: str) -> _Port:
        held = self._by_peer.get(peer)
        if held is not None:
            if held.released is not None:
                held.released.cancel()
                held.released = None
            return held
        if len(self._by_peer) >= len(self.ports):
            raise ValueError(f"the relay has no free port ({len(self.ports)} peers are relayed): try again later")
        taken = {p.port for p in self._by_peer.values()}
        for port in self.ports:
            if port and port in taken:
                continue
            box: list[_Port] = []
            try:
                server = await asyncio.start_server(self._incoming_to(box), self.host, port)
            except OSError as exc:
                logger.info("relay: port %d is not free (%s)", port, exc)
                continue
            port = server.sockets[0].getsockname()[1]  # the one the system picked for 0
            box.append(_Port(peer=peer, port=port, server=server))
            self._by_peer[peer] = box[0]
            return box[0]
        raise ValueError(f"the relay has no free port ({len(self.ports)} peers are relayed): try again later")

    def _incoming_to(
        self, box: list[_Port]
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]:
        """The port's connection handler (its ``_Port``, in ``box``, exists once it listens)."""

        async def incoming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._on_incoming(box[0], reader, writer)

        return incoming

    def _release(self, held: _Port) -> None:
        if self._by_peer.get(held.peer) is held:
            del self._by_peer[held.peer]
        held.server.close()
        for conn_id, future in list(held.pending.items()):
            self._pending.pop(conn_id, None)
            future.cancel()
        logger.info("relay: released port %d of %s", held.port, held.peer)

    async def _on_incoming(self, held: _Port, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = _observed(writer)
        if held.control is None or held.active + len(held.pending) >= MAX_CONNS_PER_PORT or source is None:
            writer.close()
            return
        conn_id = secrets.randbits(64)  # not guessable: only the peer told of it takes it
        future: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = self._loop.create_future()
        held.pending[conn_id], self._pending[conn_id] = future, held
        try:
            held.control.write(encode(Incoming(conn_id, *source)))
            taken = await asyncio.wait_for(future, TAKE_S)
        except (TimeoutError, asyncio.CancelledError, ConnectionError):
            writer.close()
            return
        finally:
            held.pending.pop(conn_id, None)
            self._pending.pop(conn_id, None)
        held.active += 1
        counts: tuple[list[int], list[int]] = ([0], [0])
        self._live[conn_id] = counts
        try:
            await splice((reader, writer), taken, counts)
        finally:
            held.active -= 1
            del self._live[conn_id]
            self._relayed += counts[0][0] + counts[1][0]

    async def _punch_ask(self, ask: PunchAsk, peer: str, writer: asyncio.StreamWriter) -> None:
        """Tell the holder of ``ask.port`` where the asker's socket comes from; once it answers
        from a fresh socket, tell the asker (``peer``, proven) where that one comes from
        (``relay.wire``)."""
        asker = _observed(writer)
        try:
            held = next((h for h in self._by_peer.values() if h.port == ask.port), None)
            if held is None or held.control is None:
                raise ValueError(f"{NOT_HELD}: {ask.port}")
            if held.peer == peer:
                raise ValueError("a peer cannot punch through to itself")
            if len(self._punches) >= MAX_PUNCHES or asker is None:
                raise ValueError("too many punches under way: try again later")
            if max(self._punching.get(peer, 0), self._punching.get(held.peer, 0)) >= MAX_PUNCHES_PER_PEER:
                raise ValueError("too many punches of this peer or to that one under way: try again later")
        except ValueError as exc:
            logger.info("relay: refused a punch: %s", exc)
            writer.write(encode(Refused(str(exc))))
            writer.close()
            return
        punch_id = secrets.randbits(64)
        answered: asyncio.Future[tuple[str, int]] = self._loop.create_future()
        self._punches[punch_id] = (answered, asker)
        for key in (peer, held.peer):
            self._punching[key] = self._punching.get(key, 0) + 1
        try:
            held.control.write(encode(PunchCall(punch_id, *asker)))
            other = await asyncio.wait_for(answered, PUNCH_ANSWER_S)
            writer.write(encode(PunchGo(*other)))
            await writer.drain()
            self.punches += 1
        except (TimeoutError, ConnectionError) as exc:
            writer.write(encode(Refused(f"the peer on port {ask.port} did not answer: {exc or type(exc).__name__}")))
        finally:
            self._punches.pop(punch_id, None)
            for key in (peer, held.peer):
                self._punching[key] -= 1
                if self._punching[key] <= 0:
                    del self._punching[key]
            writer.close()

    def _punch_answer(self, punch_id: int, writer: asyncio.StreamWriter) -> None:
        waiting = self._punches.get(punch_id)
        answerer = _observed(writer)
        if waiting is None or waiting[0].done() or answerer is None:
            writer.close()
            return
        answered, asker = waiting
        writer.write(encode(PunchGo(*asker)))
        answered.set_result(answerer)
        writer.close()

    async def _take(self, conn_id: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = self._pending.get(conn_id)
        future = held.pending.get(conn_id) if held is not None else None
        if future is None or future.done():
            writer.close()
            return
        future.set_result((reader, writer))


def _signed_by(peer: str, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is the key with public id ``peer``'s over ``data``."""
    try:
        return PublicKey.from_id(peer).verify(signature, data)
    except Exception:  # noqa: BLE001 - a malformed id or signature is no proof
        return False


def _observed(writer: asyncio.StreamWriter) -> tuple[str, int] | None:
    """The address a connection came from, as this host sees it (after any NAT on the way)."""
    peername = writer.get_extra_info("peername")
    if not peername:
        return None
    return str(peername[0]), int(peername[1])
