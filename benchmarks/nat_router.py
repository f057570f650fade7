"""A simulated host's own NAT router: what ``WanSim`` builds for a host given a ``Nat``.

A host behind NAT lives in its own namespace on a private subnet, the same one for every such
host (as home routers all hand out 192.168.1.x); its router lives in a second namespace with
the host's public address on the simulator's bridge::

    bridge (public) ==== veth ==== [router namespace]  public address, masquerade, forwards
                                   192.168.1.1 ==== veth ==== [host namespace] 192.168.1.2

The router masquerades everything the host sends out (Linux's masquerade keeps the source port
where it is free, i.e. an endpoint-independent mapping with filtering per connection, as most
home routers do); nothing from outside reaches the host unless a ``forwards`` entry maps a
public TCP port of the router to a port of the host, and what reaches neither is dropped
without an answer (a port mapping, as vast.ai maps each
container port to a random external one). The rules are nftables'; ``nft`` must be installed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

INNER_SUBNET = ipaddress.IPv4Network("192.168.1.0/24")
ROUTER_INNER = ipaddress.IPv4Interface("192.168.1.1/24")
HOST_INNER = ipaddress.IPv4Interface("192.168.1.2/24")
ROUTER_NETNS_TAG = "@nat"
"""Appended to the host's namespace name for its router's (host names cannot hold '@')."""


@dataclass(frozen=True)
class Nat:
    """The host sits behind its own NAT router.

    ``forwards`` maps a public TCP port of the router to a TCP port of the host behind it (the
    two may differ); empty: nothing from outside reaches the host.
    """

    forwards: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for external, internal in self.forwards.items():
            for what, port in (("external", external), ("internal", internal)):
                if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
                    raise ValueError(f"a NAT forward's {what} port must be 1-65535, got {port!r}")


def nft_ruleset(nat: Nat, *, public_if: str, inner_if: str) -> str:
    """The router's nftables ruleset (``nft -f -``): masquerade out of ``public_if``, each forward
    DNAT'ed to the host, a forward chain that lets in only replies and forwarded ports, and an
    input chain that drops whatever else comes from outside, as a home router's firewall does
    (rather than the kernel answering a connection to a port nobody mapped with a reset)."""
    host = HOST_INNER.ip
    dnat = "".join(
        f'        iifname "{public_if}" tcp dport {ext} counter dnat to {host}:{internal}\n'
        for ext, internal in sorted(nat.forwards.items())
    )
    return (
        "table ip swarmnat {\n"
        "    chain prerouting {\n"
        "        type nat hook prerouting priority dstnat; policy accept;\n"
        f"{dnat}"
        "    }\n"
        "    chain postrouting {\n"
        "        type nat hook postrouting priority srcnat; policy accept;\n"
        f'        oifname "{public_if}" masquerade\n'
        "    }\n"
        "    chain forward {\n"
        "        type filter hook forward priority filter; policy drop;\n"
        "        ct state established,related accept\n"
        f'        iifname "{inner_if}" accept\n'
        "        ct status dnat accept\n"
        "    }\n"
        "    chain input {\n"
        "        type filter hook input priority filter; policy accept;\n"
        f'        iifname "{public_if}" ct state established,related accept\n'
        f'        iifname "{public_if}" drop\n'
        "    }\n"
        "}\n"
    )
