"""A peer's DHT node started while its bootstrap node (the coordinator's) is down
(``engine.dht_start``), on real hivemind DHT nodes over loopback: it starts once the bootstrap
node is back, or says after its wait that nobody answered, leaving no process behind.

The churn lab's crash, reproduced: a peer that joined just before its coordinator went down
started its DHT node during the outage, and hivemind's daemon refused to start ("failed to
connect to bootstrap peers"): the peer exited with a traceback."""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from engine.dht_start import start_dht
from protocol.errors import BootstrapError

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
OUTAGE_S = 4.0


def _bootstrap_node_then_down() -> tuple[list[str], str, str]:
    """A bootstrap node's addresses, its key file and port, after it went down."""
    identity = Path(tempfile.mkdtemp(prefix="swarmtrain-dht-start-")) / "boot.key"
    boot = DHT(start=True, host_maddrs=LOOPBACK, identity_path=str(identity))
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    boot.shutdown()
    return maddrs, str(identity), maddrs[0].split("/tcp/")[1].split("/")[0]


def test_a_node_started_while_its_bootstrap_node_is_down_starts_once_it_is_back() -> None:
    maddrs, identity, port = _bootstrap_node_then_down()
    back: list[DHT] = []

    def come_back() -> None:
        time.sleep(OUTAGE_S)  # the outage itself, not a wait for a condition
        back.append(DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=identity))

    returner = threading.Thread(target=come_back, daemon=True)
    returner.start()
    started_at = time.monotonic()
    node = start_dht(lambda: DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=False), wait_s=60)
    try:
        waited = time.monotonic() - started_at
        returner.join(timeout=30)
        assert back, "the bootstrap node did not come back"
        assert waited >= OUTAGE_S - 1, f"started after {waited:.1f} s, while its bootstrap node was still down"
        # joined to the bootstrap node: what one stores, the other reads
        assert node.store("dht-start-test", "here", expiration_time=get_dht_time() + 60)
        found = back[0].get("dht-start-test", latest=True)
        assert found is not None and found.value == "here"
    finally:
        node.shutdown()
        for dht in back:
            dht.shutdown()


def test_a_node_whose_bootstrap_node_stays_down_says_so_and_leaves_no_process() -> None:
    maddrs, _identity, _port = _bootstrap_node_then_down()
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(BootstrapError, match="none of the swarm's bootstrap peers answered within 3 s"):
        start_dht(lambda: DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=False), wait_s=3)
    assert {child.pid for child in multiprocessing.active_children()} <= before


def test_a_stop_request_ends_the_wait_for_a_bootstrap_node_at_once() -> None:
    """Ctrl-C (or ``docker stop``) while a peer waits for its bootstrap node ends the wait: the
    CLI's pause raises ``SystemExit`` once the stop is set, and the failed node is reaped."""
    maddrs, _identity, _port = _bootstrap_node_then_down()
    stop = threading.Event()

    def pause(seconds: float) -> None:
        stop.set()  # the user stops the peer during its first pause
        if stop.wait(seconds):
            raise SystemExit(0)

    before = {child.pid for child in multiprocessing.active_children()}
    started_at = time.monotonic()
    with pytest.raises(SystemExit):
        start_dht(lambda: DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=False), wait_s=600, sleep=pause)
    assert time.monotonic() - started_at < 60, "the wait went on after the stop"
    assert {child.pid for child in multiprocessing.active_children()} <= before
