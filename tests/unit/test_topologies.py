"""Named topologies of the internet lab (``benchmarks.topologies``): who sits where, behind
which router, with which link and delay; bad names and sizes refused."""

from __future__ import annotations

import pytest

from benchmarks.netsim import Nat
from benchmarks.topologies import MAPPED_BASE, PEER_PORT, lab, public_run, rtt_ms, topology


def test_mixed_puts_one_peer_in_a_datacenter_one_on_a_rented_gpu_and_the_rest_at_home() -> None:
    where = topology("mixed", 5)
    assert where.places == {"p0": "datacenter", "p1": "rented", "p2": "home", "p3": "home", "p4": "home"}
    assert where.hosts == ["coord", "p0", "p1", "p2", "p3", "p4"]
    assert where.announce_ports == {"p1": MAPPED_BASE + 1}
    kwargs = where.sim_kwargs()
    assert kwargs["nat"] == {
        "p1": Nat(forwards={MAPPED_BASE + 1: PEER_PORT}),
        "p2": Nat(),
        "p3": Nat(),
        "p4": Nat(),
    }
    assert kwargs["rates"] == {
        "coord": "1gbit",
        "p0": "1gbit",
        "p1": "1gbit",
        "p2": "50mbit",
        "p3": "50mbit",
        "p4": "50mbit",
    }
    assert kwargs["delays"]["coord"] == 2.5 and kwargs["delays"]["p2"] == 20.0


def test_the_rtts_span_what_volunteers_see() -> None:
    assert rtt_ms("home", "home") == 80.0
    assert rtt_ms("datacenter", "datacenter") == 10.0
    assert rtt_ms("home", "rented") == 60.0


def test_every_peer_of_rented_gpu_has_its_own_mapped_port() -> None:
    where = topology("rented-gpu", 3)
    assert where.announce_ports == {"p0": MAPPED_BASE, "p1": MAPPED_BASE + 1, "p2": MAPPED_BASE + 2}
    assert not any(place != "rented" for place in where.places.values())


@pytest.mark.parametrize(("name", "peers", "why"), [("moon", 4, "unknown topology"), ("mixed", 1, "at least 2")])
def test_bad_topologies_are_refused(name: str, peers: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        topology(name, peers)


def test_the_plain_lab_puts_nat_routers_only_and_leaves_rate_and_delay_to_the_caller() -> None:
    where = lab(2, 2)
    assert where.hosts == ["coord", "d0", "d1", "r0", "r1"]
    assert where.sim_kwargs() == {"nat": {"r0": Nat(), "r1": Nat()}}


def test_the_public_run_lab_places_a_quarter_in_datacenters_a_quarter_rented_half_at_home() -> None:
    where = public_run(12)
    places = list(where.places.values())
    assert places[:4] == ["datacenter", "rented", "home", "home"] and places[4:8] == places[:4]
    assert [places.count(p) for p in ("datacenter", "rented", "home")] == [3, 3, 6]
    assert where.announce_ports == {"p1": MAPPED_BASE + 1, "p5": MAPPED_BASE + 5, "p9": MAPPED_BASE + 9}
    nat = where.sim_kwargs()["nat"]
    assert nat["p9"] == Nat(forwards={MAPPED_BASE + 9: PEER_PORT}) and nat["p2"] == Nat() and "p0" not in nat
    with pytest.raises(ValueError, match="at least 2"):
        public_run(1)
