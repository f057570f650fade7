"""The relay a reachable volunteer runs for peers nobody can dial (``relay.server``).

A peer whose own port the coordinator dialled back (``peer.net.network_path``: direct) offers a
relay unless told not to (``--relay-ports none``). By default (``auto``) the relay takes any
free ports, its control port checked by the coordinator's dial-back: a machine that takes a
connection on a port the system picked takes them on any, so the ports it grants later need no
check; a firewall that lets in only some ports fails the check, and the volunteer names ports it
opened (``--relay-ports FIRST-LAST``: each is checked, the ones the dial-back does not reach are
left out). Free ports also never collide with another peer's ``--port`` on the same machine.
The peer's next join names the control port (``JoinBody.relay_port``). The coordinator lists the
relays of the peers online in its join answers, and a peer nobody can dial asks them for a
port before it asks the coordinator's relay: relayed traffic spreads over the volunteers'
uplinks instead of all crossing the coordinator's.

Caps: the ports granted (one per relayed peer) and ``MAX_CONNS_PER_PORT`` connections each.
Admission: a valid access token of the run (``run_token_admission``); a relayed peer still
averages only with admitted members (the swarm's gate), and the relay sees only ciphertext.
A peer reached at an announced address (a port mapping) does not relay: its relay's ports
would need mappings of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from peer.net.dial_back import Greeter, ask_dial_back
from protocol.errors import ConfigError
from protocol.identity import PublicKey
from relay.server import Relay, RelayStats, describe_ports, parse_port_range, run_token_admission

logger = logging.getLogger(__name__)

AUTO_GRANTS = 8
"""``--relay-ports auto``: the peers a volunteer relays at most, each on any free port."""

PROBE_TIMEOUT_S = 15.0
PROBE_THREADS = 4


def relay_ports(flag: str) -> tuple[list[int] | None, str]:
    """The ports ``--relay-ports`` asks for (the first is the control port, the others are
    granted; 0: any free port) and, when none, why: ``none`` opts out; ``auto`` takes any free
    ports for a control port and ``AUTO_GRANTS`` grants; ``FIRST-LAST`` names them. A
    ConfigError for anything else."""
    if flag.strip().lower() == "auto":
        return [0] * (1 + AUTO_GRANTS), ""
    ports = parse_port_range(flag)
    if ports is None:
        return None, "--relay-ports none"
    if len(ports) < 2:
        raise ConfigError(f"--relay-ports needs a control port and at least one port to grant, got {flag!r}")
    return list(ports), ""


@dataclass(frozen=True)
class RelayOffer:
    """The relay this peer runs (``relay`` None: it runs none, ``why`` says why)."""

    relay: Relay | None
    why: str
    control_port: int = 0
    granted: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.relay is None:
            return f"off ({self.why})"
        return (
            f"serving peers nobody can dial on port {self.control_port}, granting "
            f"{describe_ports(self.granted)} ({self.why})"
        )

    def stats(self) -> RelayStats | None:
        return self.relay.stats() if self.relay is not None else None

    def close(self) -> None:
        if self.relay is not None:
            self.relay.stop()


def offer_relay(
    ports: Sequence[int] | None,
    why_not: str,
    *,
    stub: Any,
    coordinator_key: PublicKey,
    run_digest: str,
    host: str = "0.0.0.0",
    probe: Callable[[Any, int], tuple[bool, str, int]] | None = None,
    revoked: Callable[[], frozenset[str]] = frozenset,
) -> RelayOffer:
    """Start this peer's relay on ``ports`` (see ``relay_ports``) if the coordinator behind
    ``stub`` reaches them: the control port must answer (0: a free port the system picks, then
    checked); of the named ports to grant, those it does not reach are left out (0s are not
    checked: a machine reached on a picked port is reached on any). Never raises for the
    network: a relay that cannot run is an ``off`` offer. ``revoked()``: the peer keys whose
    admission the coordinator revoked (its signed list in the DHT, ``MemberGate.revoked``):
    their tokens open nothing here, as at the coordinator's own relay."""
    if ports is None:
        return RelayOffer(None, why_not)
    check = probe or _dialled_back
    control, wanted = ports[0], list(ports[1:])
    reached, why, control = check(stub, control)
    if not reached:
        return RelayOffer(None, f"the coordinator {why}")
    named = [port for port in wanted if port]
    with ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="relay-probe") as pool:
        reaches = dict(zip(named, (r[0] for r in pool.map(lambda p: check(stub, p), named))))
    granted = [port for port in wanted if reaches.get(port, True)]
    if not granted:
        return RelayOffer(
            None, f"the coordinator reaches its control port {control} but none of {describe_ports(wanted)}"
        )
    closed = [port for port in wanted if not reaches.get(port, True)]
    relay = Relay(
        host=host,
        control_port=control,
        ports=granted,
        admit=run_token_admission(coordinator_key=coordinator_key, run_digest=run_digest, revoked=revoked),
    )
    try:
        relay.start()
    except OSError as exc:
        relay.stop()
        return RelayOffer(None, f"cannot listen on port {control}: {exc.strerror or exc}")
    note = f"; the coordinator cannot reach {describe_ports(closed)}" if closed else ""
    why = "the coordinator reached it" if not named else f"the coordinator reached them{note}"
    return RelayOffer(relay, why, control, tuple(granted))


def _dialled_back(stub: Any, port: int) -> tuple[bool, str, int]:
    """Whether the coordinator's dial-back reaches ``port`` of this machine (0: a free port the
    system picks), what it found, and the port checked."""
    try:
        greeter = Greeter(port)
    except OSError as exc:
        return False, f"was not asked: port {port} is taken here ({exc.strerror or exc})", port
    try:
        seen = ask_dial_back(stub, greeter, timeout_s=PROBE_TIMEOUT_S)
    except grpc.RpcError as exc:
        return False, f"was not asked: its dial-back failed ({exc.code().name if hasattr(exc, 'code') else exc})", port
    finally:
        greeter.close()
    return seen.reached, seen.why, greeter.port
