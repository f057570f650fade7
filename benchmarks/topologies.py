"""Named internet topologies for the lab (``benchmarks.netsim``): where each volunteer sits.

- **home**: a home connection: behind its own NAT router (nftables masquerade), nothing
  forwarded, 50 Mbit/s both ways, 20 ms one way to the internet.
- **rented**: a rented GPU with a port mapping (vast.ai, RunPod): behind a router that maps
  external port ``40000 + i`` to the peer's port, as a provider does, so the peer announces
  ``HOST:40000+i`` (``--announce``); 1 Gbit/s, 10 ms.
- **datacenter**: a public address, 1 Gbit/s, 2.5 ms.

The coordinator sits in a datacenter. Two hosts' RTT is twice the sum of their one-way delays:
home to home 80 ms, home to rented 60 ms, rented to rented 40 ms, datacenter to datacenter
10 ms, home to the coordinator 45 ms. Every delay is a user-space link (the kernel has no
netem), every rate a ``tc tbf``.

Topologies (``--topology`` of ``benchmarks.nat_paths``): ``home-nat`` (every peer at home),
``rented-gpu`` (every peer rented), ``datacenter`` (every peer in one) and ``mixed`` (one
datacenter peer, one rented, the rest at home); ``public_run`` places the churn lab's peers in
turn (a quarter in datacenters, a quarter rented, half at home).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from benchmarks.netsim import Nat

Place = Literal["home", "rented", "datacenter"]

PEER_PORT = 7700
MAPPED_BASE = 40000
PLACES: dict[str, tuple[str, float]] = {
    "home": ("50mbit", 20.0),
    "rented": ("1gbit", 10.0),
    "datacenter": ("1gbit", 2.5),
}
"""Each place's link rate (both ways) and one-way delay in ms."""

TOPOLOGIES: dict[str, tuple[Place, ...]] = {
    "home-nat": ("home",),
    "rented-gpu": ("rented",),
    "datacenter": ("datacenter",),
    "mixed": ("datacenter", "rented", "home"),
}
"""Each topology's places: peer ``i`` sits at the i-th place, the last repeating."""


@dataclass(frozen=True)
class Topology:
    name: str
    places: dict[str, Place]
    """Each peer host's place (the coordinator, ``coord``, is in a datacenter)."""
    announce_ports: dict[str, int] = field(default_factory=dict)
    """Rented peers: the external port their router maps to ``PEER_PORT``."""
    shaped: bool = True
    """Whether each place's link rate and delay apply (else: one rate for all, set by the
    caller, and no delay)."""

    @property
    def hosts(self) -> list[str]:
        return ["coord", *self.places]

    def sim_kwargs(self) -> dict[str, object]:
        """``WanSim`` keyword arguments: rates, delays (when ``shaped``) and NAT routers per host."""
        where: dict[str, Place] = {"coord": "datacenter", **self.places}
        nat = {host: Nat() for host, place in self.places.items() if place == "home"}
        nat |= {host: Nat(forwards={port: PEER_PORT}) for host, port in self.announce_ports.items()}
        if not self.shaped:
            return {"nat": nat}
        return {
            "rates": {host: PLACES[place][0] for host, place in where.items()},
            "delays": {host: PLACES[place][1] for host, place in where.items()},
            "nat": nat,
        }


def topology(name: str, peers: int) -> Topology:
    """Topology ``name`` with ``peers`` peers (hosts ``p0``, ``p1``, ...); ValueError for an
    unknown name or fewer than 2 peers."""
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    if peers < 2:
        raise ValueError(f"a topology needs at least 2 peers, got {peers}")
    order = TOPOLOGIES[name]
    places: dict[str, Place] = {f"p{i}": order[min(i, len(order) - 1)] for i in range(peers)}
    mapped = {host: MAPPED_BASE + i for i, (host, place) in enumerate(places.items()) if place == "rented"}
    return Topology(name, places, mapped)


PUBLIC_RUN: tuple[Place, ...] = ("datacenter", "rented", "home", "home")
"""The public-run lab's places, in turn: a quarter of the peers in datacenters, a quarter on
rented GPUs, half at home (``benchmarks.churn``)."""


def public_run(peers: int) -> Topology:
    """``peers`` hosts ``p0``... placed by ``PUBLIC_RUN`` in turn (peer ``i`` at
    ``PUBLIC_RUN[i % 4]``), rented ones with their port mappings; ValueError under 2 peers."""
    if peers < 2:
        raise ValueError(f"a topology needs at least 2 peers, got {peers}")
    places: dict[str, Place] = {f"p{i}": PUBLIC_RUN[i % len(PUBLIC_RUN)] for i in range(peers)}
    mapped = {host: MAPPED_BASE + i for i, (host, place) in enumerate(places.items()) if place == "rented"}
    return Topology("public-run", places, mapped)


def lab(n_direct: int, n_relayed: int) -> Topology:
    """The plain lab: ``n_direct`` peers with public addresses (``d0``, ...), ``n_relayed``
    each behind its own NAT router (``r0``, ...), every link at one rate, no added delay."""
    places: dict[str, Place] = {f"d{i}": "datacenter" for i in range(n_direct)}
    places |= {f"r{i}": "home" for i in range(n_relayed)}
    return Topology("lab", places, shaped=False)


def rtt_ms(a: Place, b: Place) -> float:
    """The RTT between hosts at places ``a`` and ``b``."""
    return 2 * (PLACES[a][1] + PLACES[b][1])
