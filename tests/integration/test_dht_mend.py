"""A swarm whose DHT split in an outage joins up again through its bootstrap node
(``engine.dht_mend``), on real hivemind DHT nodes over loopback.

The churn lab's fork, reproduced at its root: two peers bootstrapped from one node (the
coordinator's) forget each other and the bootstrap node, as hivemind does with every node whose
request timed out while the coordinator was down; the bootstrap node comes back at its address
under its identity, knowing nobody. Without the mend, a record one peer stores is never seen by
the other (two DHTs); with it, both rejoin through the bootstrap node and the record is read."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from engine.dht_mend import keep_bootstrapped

KEY = "mend-test.digests"
QUICK = {"check_s": 0.5, "mend_every_s": 3600.0}
"""A check every half second; no periodic mend (only a dropped bootstrap peer triggers one)."""


async def _forget_everyone(_dht: DHT, node: Any) -> int:
    """Drop every node from this node's routing table, as timed-out requests do."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


def _split_after_outage(mend: bool) -> tuple[DHT, DHT, DHT]:
    """A bootstrap node and two peers that forgot each other and it; the bootstrap node restarted."""
    identity = Path(tempfile.mkdtemp(prefix="swarmtrain-mend-")) / "boot.key"
    boot = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(identity))
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    port = maddrs[0].split("/tcp/")[1].split("/")[0]
    peers = []
    for _ in range(2):
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
        peers.append(dht)
    boot.shutdown()
    for dht in peers:
        assert dht.run_coroutine(_forget_everyone) == 0
    boot = DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=str(identity))
    if mend:
        for dht in peers:
            dht.run_coroutine(partial(keep_bootstrapped, maddrs, **QUICK), return_future=True)
    return boot, peers[0], peers[1]


@pytest.fixture(params=[False, True], ids=["no-mend", "mend"])
def split(request: pytest.FixtureRequest) -> Iterator[tuple[bool, DHT, DHT]]:
    boot, first, second = _split_after_outage(request.param)
    try:
        yield request.param, first, second
    finally:
        for dht in (second, first, boot):
            dht.shutdown()


def test_peers_split_by_an_outage_read_each_others_records_once_they_rejoin(split: tuple[bool, DHT, DHT]) -> None:
    mend, writer, reader = split
    deadline = time.monotonic() + 10.0
    seen = False
    while time.monotonic() < deadline and not seen:
        writer.store(KEY, b"round 18", get_dht_time() + 60, subkey="writer")
        found = reader.get(KEY, latest=True)
        seen = found is not None and "writer" in found.value
        if not seen:
            time.sleep(0.5)
    assert seen is mend
