"""RelayKeeper: a relayed peer whose relays all left asks for others and moves the swarm there,
only when every tunnel has been down long enough, and says each step on one line."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from peer.net.announce import Announced
from peer.net.network_path import NetworkPath
from peer.net.relay_client import RelayAddress, RelayError
from peer.net.relay_keeper import Found, RelayKeeper


@dataclass
class FakeTunnel:
    relay: RelayAddress
    port: int
    down_since: float | None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True

    def use_token(self, token: bytes) -> None:
        pass


@dataclass
class World:
    now: float = 100.0
    listed: list[RelayAddress] = field(default_factory=list)
    opened: list[list[str]] = field(default_factory=list)
    moves: list[dict[str, object]] = field(default_factory=list)
    moved: int = 0
    said: list[str] = field(default_factory=list)
    refuse: bool = False

    def find(self) -> Found:
        return Found(tuple(self.listed), b"token")

    def open_relays(self, relays: Sequence[RelayAddress], token: bytes) -> list[tuple[FakeTunnel, RelayAddress]]:
        self.opened.append([r.host for r in relays])
        if self.refuse:
            raise RelayError("relay 10.0.0.9:7800 refused this peer: full")
        return [(FakeTunnel(r, 7801 + i), r) for i, r in enumerate(relays[:2])]

    def move(self, kwargs: dict[str, object]) -> threading.Event:
        self.moves.append(kwargs)
        done = threading.Event()
        done.set()
        return done


def _keeper(world: World) -> tuple[RelayKeeper, NetworkPath]:
    old = [FakeTunnel(RelayAddress("10.0.0.1", 7800), 7801), FakeTunnel(RelayAddress("10.0.0.2", 7800), 7802)]
    announced = tuple(Announced(host=t.relay.host, port=t.port, source="x") for t in old)
    path = NetworkPath("relayed", "a port on two relays", 7700, announced=announced, tunnels=tuple(old))  # type: ignore[arg-type]
    keeper = RelayKeeper(
        path,
        find=world.find,
        open_relays=world.open_relays,  # type: ignore[arg-type]
        move=world.move,
        moved=lambda: setattr(world, "moved", world.moved + 1),
        say=world.said.append,
        lost_after_s=20.0,
        clock=lambda: world.now,
    )
    return keeper, path


def test_one_relay_still_up_is_enough() -> None:
    world = World(listed=[RelayAddress("10.0.0.3", 7800)])
    keeper, path = _keeper(world)
    path.tunnels[0].down_since = 0.0  # type: ignore[misc]
    assert not keeper.check()
    assert world.opened == [] and world.said == []


def test_both_down_but_not_for_long_is_a_blip() -> None:
    world = World(listed=[RelayAddress("10.0.0.3", 7800)])
    keeper, path = _keeper(world)
    for tunnel in path.tunnels:
        tunnel.down_since = world.now - 5  # type: ignore[misc]
    assert not keeper.check()
    assert world.opened == []


def test_all_gone_moves_the_swarm_to_new_relays_announced() -> None:
    world = World(listed=[RelayAddress("10.0.0.1", 7800), RelayAddress("10.0.0.3", 7800, whose="the relay of c")])
    keeper, path = _keeper(world)
    old = list(path.tunnels)
    for tunnel in old:
        tunnel.down_since = world.now - 25  # type: ignore[misc]
    assert keeper.check()
    assert world.opened == [["10.0.0.3"]]  # the gone relays' hosts are not asked again
    assert all(t.closed for t in old)  # type: ignore[attr-defined]
    assert world.moves == [{"announce_maddrs": ["/ip4/10.0.0.3/tcp/7801"], "force_reachability": "public"}]
    assert world.moved == 1 and keeper.moves == 1
    assert [a.maddr for a in path.announced] == ["/ip4/10.0.0.3/tcp/7801"]
    assert world.said[0].startswith("network: the 2 relays this peer was reached at are gone (10.0.0.1, 10.0.0.2)")
    assert world.said[-1] == "network: relayed at /ip4/10.0.0.3/tcp/7801 (its relays left; a port on the relay of c)"
    assert not keeper.check()  # the new tunnel is up


def test_no_other_relay_asks_again_later_and_longer() -> None:
    world = World(listed=[RelayAddress("10.0.0.2", 7800)])
    keeper, path = _keeper(world)
    for tunnel in path.tunnels:
        tunnel.down_since = world.now - 25  # type: ignore[misc]
    assert not keeper.check()
    assert (
        world.said[-1] == "network: no other relay is online; asking again in 5 s (training goes on, its rounds fail)"
    )
    world.now += 3
    assert not keeper.check() and len(world.said) == 2  # not before its time
    world.now += 3
    world.listed.append(RelayAddress("10.0.0.4", 7800))
    world.refuse = True
    assert not keeper.check()
    assert "no new relay yet: relay 10.0.0.9:7800 refused this peer: full; asking again in 10 s" in world.said[-1]
    world.now += 11
    world.refuse = False
    assert keeper.check() and world.moves
