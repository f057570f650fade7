"""A client-mode peer (no inbound connections: it can never lead) that launches its round
before every peer that can lead still averages in that round's group, with real hivemind
swarms on loopback.

hivemind's leader turns away a join request whose expiration comes before its own (that
sender should lead instead); a client's request carried its own window, so a client that
launched first was turned away by every leader and the round, short of its third member,
failed for everyone (``test_reachability_and_leave.py``'s client, about 1 run in 3 on a loaded
machine). Its request now carries the end of its search, which lasts its timeout plus a window
(``Swarm.start_round``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from engine.codecs import get_codec
from peer.swarm.swarm import Swarm
from protocol.gathered import Gathered
from protocol.spec import parse_spec
from tests.specs import tiny_spec

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SPEC = parse_spec(
    tiny_spec(
        "client-first", d_model=16, context=16, batch_size=None, inner_steps=None, compression="none", min_group_size=3
    )
)
DIGEST = "blake3:" + "cd" * 32
NUMEL = 1000
CLIENT_AHEAD_S = 2.0
"""How long before the leaders the client launches: more than the 1 s by which its own
deadline outlasts a leader's window, less than its timeout."""


def _gather(name: str) -> Gathered:
    return Gathered(id=name, round=0, samples=10, digest=DIGEST)


@pytest.fixture
def swarms() -> Iterator[list[Swarm]]:
    made: list[Swarm] = []
    try:
        made.append(Swarm(SPEC, NUMEL, get_codec("none"), initial_peers=[], host_maddrs=LOOPBACK))
        first = made[0].visible_maddrs
        made.append(Swarm(SPEC, NUMEL, get_codec("none"), initial_peers=first, host_maddrs=LOOPBACK))
        made.append(Swarm(SPEC, NUMEL, get_codec("none"), initial_peers=first, host_maddrs=LOOPBACK, client_mode=True))
        yield made
    finally:
        for swarm in made:
            swarm.shutdown()


def test_a_client_that_launches_before_every_leader_is_in_the_group(swarms: list[Swarm]) -> None:
    *leaders, client = swarms
    in_client = client.start_round(weight=1.0, gather=_gather("client"))
    time.sleep(CLIENT_AHEAD_S)
    pending = [swarm.start_round(weight=1.0, gather=_gather(f"l{i}")) for i, swarm in enumerate(leaders)]
    results = [p.result() for p in pending] + [in_client.result()]
    assert [None if r is None else r.group_size for r in results] == [3, 3, 3]
    assert all(r is not None and r.stats.bytes_sent > 0 for r in results)
    # one of the two that can lead led, and says what forming the group cost it
    led = [r.led for r in results if r is not None and r.led is not None]
    assert len(led) == 1 and results[-1] is not None and results[-1].led is None, led
    assert led[0]["members"] == 3 and led[0]["loop_cpu_s"] > 0 and led[0]["begin_bytes"] > 0, led
