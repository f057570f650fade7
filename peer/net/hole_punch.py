"""A direct TCP connection between two peers that each sit behind a NAT, by a simultaneous open
that a relay times (``relay.wire``: ``PunchAsk``, ``PunchCall``, ``PunchAnswer``,
``PunchGo``).

Each side opens a fresh socket on a free local port and reaches the relay's control port from
it, so the relay sees the address its NAT maps that port to; the relay tells each the other's.
Both then connect to that address from the same local port, again and again for ``PUNCH_S``:
each side's outgoing SYN opens its own NAT for the other's, and once both are out the two SYNs
cross and the connection opens both ways (masquerading NATs keep the local port when it is
free, so the mapping the relay saw is the one the other side reaches). Who is at the other end
is not checked here: the libp2p session run over the socket authenticates the peer. What a
relay may make this peer dial is: the host the punch was asked from (the holder's side), never
an address more local than the relay itself (``check_target``), with at most ``MAX_ATTEMPTS``
connects a punch.

While a punched connection to a host lives, this peer's relay tunnels take a relayed
connection from that host only ``relay_client.DEFER_S`` late (``DirectPaths``): a libp2p daemon
dials every address it knows for a peer at once and keeps whichever connects first, so the
punched path wins the dial and the late relayed one is dropped by the dialler. Deferred, not
refused: a refused dial would put the relay's address in libp2p's dial backoff, and the peer
could not be reached at all while the punched path is down. Another peer behind the same
public address (a carrier-grade NAT) is relayed to this one late meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from protocol.errors import MalformedMessageError, SwarmtrainError
from relay.wire import (
    NOT_HELD,
    PUNCHING,
    Challenge,
    Message,
    PunchAnswer,
    PunchAsk,
    PunchGo,
    Refused,
    encode,
    prove,
    read_message,
)

logger = logging.getLogger(__name__)

RENDEZVOUS_S = 10.0
"""For the relay's answer: it waits up to 5 s for the other side (``relay.server.PUNCH_ANSWER_S``)."""
PUNCH_S = 6.0
ATTEMPT_S = 2.5
"""One connect: long enough for the SYN's first retransmission (after 1 s), which crosses the
other side's SYN when a NAT dropped the first one (home routers drop, some answer a reset)."""
RETRY_PAUSE_S = (0.05, 0.5)
"""The pause after a failed connect: the first, doubling up to the second."""
MAX_ATTEMPTS = 12
"""Connects one punch may try (within ``PUNCH_S``): what one message of a relay can make this
peer send to the address it names (a reset answered at once cost 100 connects a punch)."""

_SCOPES = ("loopback", "link-local", "private", "global")


def _scope(host: str) -> int:
    """How far ``host`` reaches, as an index of ``_SCOPES`` (-1: an address nobody is dialled at:
    unspecified, multicast, reserved). A name counts as global."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return len(_SCOPES) - 1
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        return -1
    if address.is_loopback:
        return 0
    if address.is_link_local:
        return 1
    if address.is_private:
        return 2
    return 3


def check_target(relay_host: str, host: str, port: int) -> None:
    """Refuse (``PunchError``) a punch target a relay at ``relay_host`` may not send this peer
    to: no port, an address nobody is dialled at, or one more local than the relay itself (a
    public relay names public addresses: never this machine's loopback, its link or its LAN,
    where a hostile relay would use the peer as a scanner of what its firewall keeps out; a
    relay on the LAN or this machine may name hosts there)."""
    if not 0 < port < 65536:
        raise PunchError(f"the relay named port {port} to punch to")
    scope, reach = _scope(host), _scope(relay_host)
    if scope < 0 or scope < reach:
        where = _SCOPES[scope] if scope >= 0 else "undialable"
        raise PunchError(f"the relay at {relay_host} named a {where} address to punch to ({host}): refused")


class DirectPaths:
    """The hosts this peer has a punched connection with now (thread-safe): their relayed
    connections are taken late."""

    def __init__(self) -> None:
        self._hosts: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def held(self, host: str) -> Iterator[None]:
        """``host`` counts as reached directly while the block runs."""
        with self._lock:
            self._hosts[host] += 1
        try:
            yield
        finally:
            with self._lock:
                self._hosts[host] -= 1
                if self._hosts[host] <= 0:
                    del self._hosts[host]

    def __contains__(self, host: object) -> bool:
        with self._lock:
            return host in self._hosts

    def __len__(self) -> int:
        """Hosts reached directly now: the peers behind them, unless two share a NAT."""
        with self._lock:
            return len(self._hosts)


class PunchError(SwarmtrainError):
    """No direct connection: the relay refused, or the simultaneous open did not connect."""


class NotRelayed(PunchError):
    """The port asked for is no relayed peer's on that relay."""


def _bound(port: int) -> socket.socket:
    """A non-blocking TCP socket on ``port`` (0: a free one) that may share it with the
    rendezvous socket closed a moment before (``SO_REUSEADDR``, ``SO_REUSEPORT``), with no
    Nagle delay."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # asyncio turns Nagle's algorithm off only on sockets whose proto says TCP, and only on those
    # it makes itself: with it on, libp2p's small messages wait for delayed ACKs, measured in the
    # NAT lab as 2-3 s all-reduces over punched connections against 0.3 s through a relay
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setblocking(False)
    try:
        sock.bind(("0.0.0.0", port))
    except OSError:
        sock.close()
        raise
    return sock


async def _rendezvous(
    relay: tuple[str, int], first: Message, sign: Callable[[bytes], bytes] | None = None
) -> tuple[int, PunchGo]:
    """Send ``first`` to the relay from a fresh socket (a ``PunchAsk``: proving its token with
    ``sign`` when the relay challenges it); its local port and the relay's ``PunchGo``."""
    loop = asyncio.get_running_loop()
    sock = _bound(0)
    local = int(sock.getsockname()[1])
    where = f"{relay[0]}:{relay[1]}"
    try:
        await asyncio.wait_for(loop.sock_connect(sock, relay), RENDEZVOUS_S)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, (OSError, TimeoutError)):
            raise PunchError(f"relay {where}: {exc or type(exc).__name__}") from exc
        raise
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise
    try:
        writer.write(encode(first))
        answer = await asyncio.wait_for(read_message(reader), RENDEZVOUS_S)
        if isinstance(answer, Challenge) and isinstance(first, PunchAsk) and sign is not None:
            writer.write(encode(prove(answer, PUNCHING, first.token, sign)))
            answer = await asyncio.wait_for(read_message(reader), RENDEZVOUS_S)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, MalformedMessageError) as exc:
        raise PunchError(f"relay {where}: {exc or type(exc).__name__}") from exc
    finally:
        writer.close()
    if isinstance(answer, Refused):
        error = NotRelayed if answer.reason.startswith(NOT_HELD) else PunchError
        raise error(f"relay {where} refused the punch: {answer.reason}")
    if not isinstance(answer, PunchGo):
        raise PunchError(f"relay {where} answered {type(answer).__name__} to a punch")
    return local, answer


async def simultaneous_open(local_port: int, host: str, port: int, *, within_s: float = PUNCH_S) -> socket.socket:
    """A connected socket from ``local_port`` to ``host:port``, the other side connecting to
    this one's address at the same time; ``PunchError`` when none connects within ``within_s``."""
    loop = asyncio.get_running_loop()
    end = time.monotonic() + within_s
    tries, last, pause = 0, "", RETRY_PAUSE_S[0]
    while time.monotonic() < end and tries < MAX_ATTEMPTS:
        tries += 1
        sock = _bound(local_port)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), ATTEMPT_S)
        except (OSError, TimeoutError) as exc:
            sock.close()
            last = str(exc) or type(exc).__name__
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_PAUSE_S[1])
            continue
        except BaseException:  # cancelled (the peer is stopping)
            sock.close()
            raise
        return sock
    raise PunchError(f"no direct connection to {host}:{port} from port {local_port} in {tries} tries ({last})")


async def punch(relay: tuple[str, int], *, token: bytes, sign: Callable[[bytes], bytes], port: int) -> socket.socket:
    """The asker's side: a direct connection to the peer holding ``port`` on the relay at
    ``relay`` (its control port); ``sign`` signs with the key ``token`` names."""
    local, go = await _rendezvous(relay, PunchAsk(token, port), sign)
    check_target(relay[0], go.host, go.port)
    return await simultaneous_open(local, go.host, go.port)


async def answer(relay: tuple[str, int], punch_id: int, asker: str) -> socket.socket:
    """The holder's side, told of a punch by ``PunchCall(punch_id, asker, ...)``: a direct
    connection to the asker (the relay's ``PunchGo`` must name the host its call did)."""
    local, go = await _rendezvous(relay, PunchAnswer(punch_id))
    if go.host != asker:
        raise PunchError(f"the relay called for a punch from {asker} but named {go.host} to punch to: refused")
    check_target(relay[0], go.host, go.port)
    return await simultaneous_open(local, go.host, go.port)
