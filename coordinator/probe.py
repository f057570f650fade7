"""The coordinator's answer to ``swarmtrain doctor`` (the ``Probe`` RPC).

A volunteer's machine asks before it joins, unauthenticated: the run's spec and digest, the
software version and the bootstrap peers; the coordinator's clock (for skew); a payload up
and down (for bandwidth); and a dial-back: the coordinator opens a TCP connection to the
caller's address *as it saw it* on a port the caller names and tells whether it read there
the greeting the caller said it serves (``dial_back_expect``), so the caller knows its own
listener was reached (Petals' is-reachable check, without a third party).

What a stranger can do with it is bounded: the coordinator never dials another host than the
one the request came from, returns no byte it read (only whether they were the caller's own
greeting: no banner of another service comes back), reads at most ``GREETING_BYTES``, gives
each dial-back ``DIAL_TIMEOUT_S`` in all (connecting and reading: a listener that drips one
byte at a time holds it no longer), runs at most ``MAX_CONCURRENT_DIALS`` at once and one per
source, and answers each source at most ``PROBES_PER_MINUTE`` probes (a doctor run sends
six). A loopback source is a proxy in front of the coordinator (or a local run): its failed
dial-backs all read "did not serve the greeting", so that the coordinator's own ports cannot
be told open from closed through it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

from coordinator.ratelimit import SourceLimiter
from protocol import coordinator_pb2 as pb
from protocol.errors import DIAL_BACK_BUSY, MalformedMessageError, SwarmtrainError
from protocol.version import __version__

logger = logging.getLogger(__name__)

PROBE_MAX_BYTES = 512 << 10
"""Largest payload either way (well under the server's request limit)."""
GREETING_BYTES = 64
DIAL_TIMEOUT_S = 3.0
MAX_CONCURRENT_DIALS = 8
PROBES_PER_MINUTE = 60


class ProbeLimitError(SwarmtrainError):
    """Too many probes from one source, or too many dial-backs at once."""


class Prober:
    """Answers ``ProbeRequest``s; thread-safe (every field it reads is fixed at start)."""

    def __init__(
        self,
        *,
        spec_toml: str,
        spec_digest: str,
        bootstrap_maddrs: Callable[[], list[str]],
        relay_port: Callable[[], int] = lambda: 0,
        volunteer_relays: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.relay_port, self.volunteer_relays = relay_port, volunteer_relays
        self.spec_toml, self.spec_digest, self.bootstrap_maddrs, self.clock = (
            spec_toml,
            spec_digest,
            bootstrap_maddrs,
            clock,
        )
        self.limiter = SourceLimiter(rate=PROBES_PER_MINUTE / 60, burst=PROBES_PER_MINUTE / 2)
        self._dials = threading.BoundedSemaphore(MAX_CONCURRENT_DIALS)
        self._dialing: set[str] = set()
        """Sources with a dial-back running (one each)."""
        self._lock = threading.Lock()

    def answer(self, request: pb.ProbeRequest, *, source: str) -> pb.ProbeResponse:
        """The response to ``request`` from ``source`` (the caller's host, as the server saw it).
        Raises ``MalformedMessageError`` for out-of-range fields, ``ProbeLimitError`` over the
        limits; neither changes anything."""
        port, want, expect = request.dial_back_port, request.download_bytes, request.dial_back_expect
        if not 0 <= port <= 65535:
            raise MalformedMessageError(f"dial_back_port must be 0 (none) or a TCP port 1-65535, got {port}")
        if port and not 1 <= len(expect) <= GREETING_BYTES:
            raise MalformedMessageError(
                f"dial_back_expect must be the 1-{GREETING_BYTES} bytes the caller serves on its port, "
                f"got {len(expect)} (update swarmtrain)"
            )
        if not 0 <= want <= PROBE_MAX_BYTES:
            raise MalformedMessageError(f"download_bytes must be in [0, {PROBE_MAX_BYTES}], got {want}")
        if len(request.payload) > PROBE_MAX_BYTES:
            raise MalformedMessageError(f"payload is {len(request.payload)} bytes, more than {PROBE_MAX_BYTES}")
        if not self.limiter.allow(source, time.monotonic()):
            raise ProbeLimitError(f"more than {PROBES_PER_MINUTE} probes a minute from {source}: wait a minute")
        response = pb.ProbeResponse(
            software_version=__version__,
            spec_digest=self.spec_digest,
            spec_toml=self.spec_toml,
            bootstrap_maddrs=self.bootstrap_maddrs(),
            observed_host=source,
            received_bytes=len(request.payload),
            payload=bytes(want),
            relay_port=self.relay_port(),
            volunteer_relays=self.volunteer_relays(),
        )
        if port:
            response.dialed = True
            response.dial_matched, response.dial_error = self._dial(source, port, expect)
        response.server_time = self.clock()  # last: the caller pairs it with the reply's arrival
        return response

    def _dial(self, host: str, port: int, expect: bytes) -> tuple[bool, str]:
        """(whether ``host:port`` served exactly ``expect`` within ``DIAL_TIMEOUT_S`` in all, why not)."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False, f"cannot dial back {host!r}: not an IP address"
        with self._lock:
            if host in self._dialing:
                raise ProbeLimitError(f"{DIAL_BACK_BUSY}: a dial-back to {host} is running: one at a time per source")
            if not self._dials.acquire(blocking=False):
                raise ProbeLimitError(
                    f"{DIAL_BACK_BUSY}: {MAX_CONCURRENT_DIALS} dial-backs are running: try again in a few seconds"
                )
            self._dialing.add(host)
        try:
            matched, error = _read_greeting(host, port, expect, time.monotonic() + DIAL_TIMEOUT_S)
        finally:
            with self._lock:
                self._dialing.discard(host)
                self._dials.release()
        if not matched and address.is_loopback:
            error = f"{host}:{port} did not serve the caller's greeting"
        return matched, error


def _read_greeting(host: str, port: int, expect: bytes, deadline: float) -> tuple[bool, str]:
    """Connect to ``host:port`` and read until ``len(expect)`` bytes arrived, the peer closed or
    ``deadline`` (monotonic) passed: (whether exactly ``expect`` was read, why no connection
    or no greeting came: "" when another program answered)."""
    try:
        with socket.create_connection((host, port), timeout=DIAL_TIMEOUT_S) as conn:
            greeting = b""
            while len(greeting) < len(expect):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)
                chunk = conn.recv(len(expect) - len(greeting))
                if not chunk:
                    break
                greeting += chunk
    except TimeoutError:
        return False, f"no answer from {host}:{port} within {DIAL_TIMEOUT_S:g} s"
    except OSError as exc:
        return False, f"{host}:{port}: {exc.strerror or exc}"
    return greeting == expect, ""  # not the greeting: another program answered there
