"""Can anyone dial this machine? The coordinator's dial-back (its ``Probe`` RPC) answers it:
it connects to the host it saw the request come from, on a port this machine names, and
says whether it read there the greeting this machine said it serves. A ``Greeter`` on that
port writes a random greeting, so an answer from another program (or a NAT router's own
service) does not count. The
doctor runs it, and so does a peer before it chooses how it is reached (``peer.net.network_path``).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from protocol import coordinator_pb2 as pb
from protocol.errors import DIAL_BACK_BUSY

BUSY_WAIT_S = 10.0
"""How long a probe refused as busy (``DIAL_BACK_BUSY``) is asked again: the dial-back it waits on
takes at most ``coordinator.probe.DIAL_TIMEOUT_S`` (3 s)."""
BUSY_PAUSE_S = 0.5
"""The pause before each new ask (60 probes a minute are allowed a source)."""


@dataclass(frozen=True)
class DialBack:
    """What the coordinator's dial-back found."""

    observed_host: str
    """This machine's address as the coordinator saw it."""
    port: int
    reached: bool
    """Whether it read this greeter's greeting there."""
    error: str = ""
    relay_port: int = 0
    """The coordinator's relay port (0: it runs none)."""
    volunteer_relays: int = 0
    """Volunteers' relays a join answer would list now."""

    @property
    def why(self) -> str:
        """What happened, as the end of a sentence that starts "the coordinator ..."."""
        where = f"{self.observed_host}:{self.port}"
        if self.reached:
            return f"reached this machine at {where}"
        if self.error:
            return f"cannot reach {where} ({self.error})"
        return f"reached {where}, but another program answered there"


class Greeter:
    """A TCP listener on ``port`` (all interfaces) that writes ``greeting`` to whoever connects:
    what the coordinator's dial-back must read back."""

    def __init__(self, port: int) -> None:
        self.greeting = b"swarmtrain-dial-back " + secrets.token_hex(16).encode()
        dual = socket.has_dualstack_ipv6()  # the coordinator may dial back over IPv6
        family = socket.AF_INET6 if dual else socket.AF_INET
        self.sock = socket.create_server(("", port), family=family, dualstack_ipv6=dual)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="dial-back-greeter")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(self.greeting)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)


def ask_dial_back(stub: Any, greeter: Greeter, *, timeout_s: float, port: int = 0) -> DialBack:
    """Ask the coordinator behind ``stub`` to dial this machine back on ``port`` (default:
    ``greeter``'s; another one where a port mapping forwards it to the greeter) and read the
    greeting (raises ``grpc.RpcError`` when it refuses the probe; one refused because another
    machine at this address is being dialled back is asked again for up to ``BUSY_WAIT_S``)."""
    port = port or greeter.port
    request = pb.ProbeRequest(dial_back_port=port, dial_back_expect=greeter.greeting)
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            info = stub.Probe(request, timeout=timeout_s)
            break
        except grpc.RpcError as exc:
            # another machine at this address is being dialled back (``DIAL_BACK_BUSY``): a
            # moment's wait, not a verdict on this one's reachability
            busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and DIAL_BACK_BUSY in str(exc.details())
            if not busy or time.monotonic() + BUSY_PAUSE_S > deadline:
                raise
            time.sleep(BUSY_PAUSE_S)
    reached = not info.dial_error and info.dial_matched
    return DialBack(info.observed_host, port, reached, info.dial_error, info.relay_port, info.volunteer_relays)
