"""A peer bootstraps from the coordinator's DHT addresses on the host it reached its API on."""

from __future__ import annotations

from peer.swarm.bootstrap import bootstrap_for

MADDRS = ["/ip4/127.0.0.1/tcp/1/p2p/QmX", "/ip4/192.0.2.2/tcp/1/p2p/QmX", "/ip4/10.1.2.3/tcp/1/p2p/QmX"]


def test_the_address_the_peer_reached_the_coordinator_on_wins() -> None:
    assert bootstrap_for(MADDRS, "127.0.0.1:7500") == [MADDRS[0]]
    assert bootstrap_for(MADDRS, "localhost:7500") == [MADDRS[0]]
    assert bootstrap_for(MADDRS, "10.1.2.3:7500") == [MADDRS[2]]


def test_no_match_or_no_resolution_falls_back_to_every_address() -> None:
    assert bootstrap_for(MADDRS, "10.9.9.9:7500") == MADDRS
    assert bootstrap_for(MADDRS, "no-such-host.invalid:7500") == MADDRS
    assert bootstrap_for([], "127.0.0.1:7500") == []
