"""Which of a coordinator's DHT addresses a peer bootstraps from.

A coordinator listening on all interfaces hands out one multiaddr per interface (loopback,
LAN, docker bridges, public). If a peer's libp2p daemon happens to connect over an address
that libp2p considers unroutable (documentation and benchmarking ranges such as 192.0.2.0/24
or 198.18.0.0/15: neither private nor public), the coordinator's identify protocol keeps
none of the peer's listen addresses, its DHT cannot tell other peers where this one is
("routing: not found"), and every averaging round fails with "could not find a group"
(measured: 4 of 13 runs with two peers on one machine). The address the peer already reached
the coordinator's gRPC API on is known to work, so the peer bootstraps from the DHT
addresses on that host, and from all of them only when none is.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)


def bootstrap_for(maddrs: list[str], coordinator: str) -> list[str]:
    """The coordinator's ``maddrs`` on the host of ``coordinator`` (``HOST:PORT``, as the peer
    dialed it), or all of them if none is (or the host does not resolve)."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return list(maddrs)
    wanted = set()
    for ip in ips:
        try:
            version = ipaddress.ip_address(ip).version
        except ValueError:
            continue
        wanted.add(f"/ip{version}/{ip}/")
    same = [maddr for maddr in maddrs if any(maddr.startswith(prefix) for prefix in wanted)]
    if not same:
        logger.debug("no DHT address of the coordinator is on %s; bootstrapping from all of them", host)
    return same or list(maddrs)
