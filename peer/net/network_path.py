"""How other peers reach this one, chosen once at start and printed.

- **announced**: ``--announce`` or a provider's port mapping (``peer.net.announce``); the daemon
  advertises that address only.
- **direct**: the coordinator dialled this machine back on its port (``peer.net.dial_back``), or
  the run has no coordinator to ask (the addresses the daemon sees are advertised).
- **relayed**: the dial-back failed (NAT, firewall) and relays grant it ports: volunteers'
  (the coordinator lists the relays of reachable peers, ``peer.net.relay_service``, tried first)
  or the coordinator's. The peer holds a public port on up to ``RELAYS_HELD`` of them, on
  different hosts (``peer.net.relay_client``), and announces them all: when one relay leaves, the
  others dial it at the next; when all have left, it finds others (``peer.net.relay_keeper``). It is
  a full member: it leads, reduces its part and serves state like any other; its traffic
  crosses a relay's host twice.
- **client**: ``--client-mode``, or nobody can dial it and no relay grants it a port: it sends
  its parts and receives the averages over connections it opens, and never reduces or leads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from peer.net.announce import Announced, announced, parse_host_port
from peer.net.dial_back import Greeter, ask_dial_back
from peer.net.hole_punch import DirectPaths
from peer.net.relay_client import RelayAddress, RelayError, RelayTunnel, open_several
from protocol.ports import unassigned_port

logger = logging.getLogger(__name__)

DIAL_BACK_TIMEOUT_S = 15.0

PathKind = Literal["announced", "direct", "relayed", "client"]


@dataclass
class NetworkPath:
    """How others reach this peer; a relayed peer's relays and announced addresses change when
    its relays all leave (``relayed_again``, ``peer.net.relay_keeper``), the rest never."""

    kind: PathKind
    why: str
    port: int
    """The port the daemon listens on."""
    announced: tuple[Announced, ...] = ()
    """What the daemon advertises instead of the addresses it sees (none: those)."""
    tunnels: tuple[RelayTunnel, ...] = ()
    """A relayed peer's ports on relays, one per address in ``announced``."""
    direct: DirectPaths = field(default_factory=DirectPaths)
    """Hosts reached over punched connections (``peer.net.hole_punch``), shared by the tunnels and
    the puncher."""
    dialled_back: bool = False
    """Whether the coordinator reached ``port`` (a direct peer that may relay for others)."""

    @property
    def client_mode(self) -> bool:
        return self.kind == "client"

    @property
    def dht_kwargs(self) -> dict[str, Any] | None:
        """What the DHT's daemon is started with: an announced address is the only one it
        advertises, and it is reachable there whatever AutoNAT guesses."""
        if not self.announced:
            return None
        return {"announce_maddrs": [a.maddr for a in self.announced], "force_reachability": "public"}

    def describe(self) -> str:
        where = f" at {' and '.join(a.maddr for a in self.announced)}" if self.announced else ""
        return f"{self.kind}{where} ({self.why})"

    def use_token(self, token: bytes) -> None:
        """A renewed access token for the relays (they refuse an expired one on a reconnect)."""
        for tunnel in self.tunnels:
            tunnel.use_token(token)

    def relayed_again(self, announced: tuple[Announced, ...], tunnels: tuple[RelayTunnel, ...], why: str) -> None:
        """A relayed peer now reached at ``announced`` through ``tunnels`` (its old ones closed)."""
        self.announced, self.tunnels, self.why = announced, tunnels, why

    def close(self) -> None:
        for tunnel in self.tunnels:
            tunnel.close()


@dataclass(frozen=True)
class Coordinated:
    """What a peer joined through a coordinator knows for the choice."""

    address: str
    """``HOST:PORT`` it reached the coordinator at."""
    stub: Any
    """The coordinator's gRPC stub (for the dial-back)."""
    relay_port: int
    token: Callable[[], bytes]
    """The peer's current access token (the relay admits only admitted peers)."""
    sign: Callable[[bytes], bytes]
    """Signs with the peer's key, the one its token names (a relay's challenge)."""
    relays: tuple[tuple[str, int], ...] = ()
    """Volunteers' relays (host, control port) from the join answer, in the order to try."""

    def relay_addresses(self) -> list[RelayAddress]:
        """The relays to ask for a port, in order: the volunteers', then the coordinator's."""
        volunteers = [
            RelayAddress(host, port, whose=f"the relay of volunteer {host}:{port}") for host, port in self.relays
        ]
        if not self.relay_port:
            return volunteers
        host, _ = parse_host_port(self.address, what="--coordinator")
        return [*volunteers, RelayAddress(host, self.relay_port)]


def choose_path(
    *,
    client_mode: bool,
    announce: str | None,
    port: int,
    env: Mapping[str, str],
    coordinated: Coordinated | None,
    local_host: str = "127.0.0.1",
    hole_punch: bool = False,
) -> NetworkPath:
    """The path for a peer started with these flags (see the module's docstring). ``port``: the
    ``--port`` flag (0: one is picked here when the choice needs a fixed one). ``hole_punch``: a
    relayed peer answers the punches others ask for (``peer.net.hole_punch``)."""
    if client_mode:
        return NetworkPath("client", "--client-mode", port)
    mapped = announced(announce, port=port, env=env)
    if mapped is not None:
        checked = _cross_check(mapped, port, coordinated) if coordinated is not None else ""
        return NetworkPath("announced", f"from {mapped.source}{checked}", port, announced=(mapped,))
    if coordinated is None:
        return NetworkPath("direct", "no coordinator to ask for a dial-back", port)
    port = port or unassigned_port()  # the daemon binds it a moment later
    greeter = Greeter(port)
    try:
        seen = ask_dial_back(coordinated.stub, greeter, timeout_s=DIAL_BACK_TIMEOUT_S)
    except grpc.RpcError as exc:  # e.g. rate-limited: the choice must not stop the peer
        logger.warning("the coordinator's dial-back failed: %s", exc)
        return NetworkPath("direct", f"the coordinator's dial-back failed ({exc}); assuming reachable", port)
    finally:
        greeter.close()
    if seen.reached:
        return NetworkPath("direct", f"the coordinator {seen.why}", port, dialled_back=True)
    relays = coordinated.relay_addresses()
    if not relays:
        return NetworkPath("client", f"the coordinator {seen.why}, runs no relay and lists none", port)
    try:
        direct = DirectPaths()
        held = open_several(
            relays,
            token=coordinated.token,
            sign=coordinated.sign,
            local_port=port,
            local_host=local_host,
            direct=direct,
            answer_punches=hole_punch,
        )
    except RelayError as exc:
        return NetworkPath("client", f"the coordinator {seen.why}, and no relay granted a port: {exc}", port)
    relayed = tuple(Announced(host=relay.host, port=tunnel.port, source=relay.whose) for tunnel, relay in held)
    why = f"the coordinator {seen.why}; a port on {' and '.join(relay.whose for _, relay in held)}"
    tunnels = tuple(tunnel for tunnel, _ in held)
    return NetworkPath("relayed", why, port, announced=relayed, tunnels=tunnels, direct=direct)


def _cross_check(mapped: Announced, port: int, coordinated: Coordinated) -> str:
    """The coordinator's view of an announced address, said after the path's reason: it
    dials the announced port on the host it sees this machine as, which the mapping must
    forward to ``port``. The address is announced whatever it finds (the volunteer said so)."""
    try:
        greeter = Greeter(port)
    except OSError as exc:
        return f"; not checked: cannot listen on port {port} ({exc.strerror})"
    try:
        seen = ask_dial_back(coordinated.stub, greeter, timeout_s=DIAL_BACK_TIMEOUT_S, port=mapped.port)
    except grpc.RpcError as exc:
        return f"; not checked: the coordinator's dial-back failed ({exc})"
    finally:
        greeter.close()
    elsewhere = seen.observed_host != mapped.host
    note = f"; the coordinator sees this machine as {seen.observed_host}, not {mapped.host}" if elsewhere else ""
    if seen.reached:
        return f"; the coordinator {seen.why}{note}"
    logger.warning("the announced address %s may not reach this peer: the coordinator %s", mapped.maddr, seen.why)
    return f"; WARNING: the coordinator {seen.why}{note}: check the port mapping"
