"""A port picked now for a process to listen on a moment later, outside the kernel's ephemeral range.

A port bound to 0 and closed again lies in the ephemeral range (``ip_local_port_range``): until
the process meant to listen there binds it, any other listener bound to 0 on the machine (another
peer's daemon, a gRPC server, a browser's helper) may be given the same one. One CI run lost a
peer that way: its dial-back greeter held port 42787, let go, and the libp2p daemon found it
taken ("bind: address already in use"). A port from below (or above) that range is never handed
out by the kernel, so only another process choosing the same one at random in the same instant
collides: one in tens of thousands.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["LOWEST", "ephemeral_range", "quiet_ports", "bindable", "unassigned_port"]

LOWEST = 10_000
"""No port below this is picked (well-known and registered services live there)."""
TRIES = 200
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        low, high = path.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def quiet_ports(path: Path = RANGE_FILE) -> range:
    """The wider of the gaps below and above the ephemeral range: ports the kernel never assigns."""
    low, high = ephemeral_range(path)
    below, above = range(LOWEST, max(low, LOWEST)), range(max(high + 1, LOWEST), 65_536)
    return below if len(below) >= len(above) else above


def bindable(port: int, host: str = "") -> bool:
    """Whether a listener could bind ``port`` on ``host`` ("": every interface) now."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
    except OSError:  # taken, or no IPv4 here
        return False
    return True


def unassigned_port(host: str = "", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, from :func:`quiet_ports`; one the kernel picks (in the
    ephemeral range) only where that gap is empty or full."""
    pick = rng or random.SystemRandom()
    candidates = quiet_ports()
    for _ in range(TRIES if len(candidates) else 0):
        port = pick.choice(candidates)
        if bindable(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
