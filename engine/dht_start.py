"""Starting a peer's DHT node while its bootstrap peers may be down.

hivemind's libp2p daemon refuses to start when none of the node's initial peers answers
("failed to connect to bootstrap peers"). A volunteer's bootstrap peers are, in a coordinator's
run, the coordinator's own DHT node: in a public run it restarts for upgrades and crashes, and a
peer that joined just before it went down (the join, the reachability check and the relay
reservations take seconds) starts its DHT node during the outage. The churn lab saw it: a home
peer exited with hivemind's traceback 4 s into a 20 s coordinator outage. ``start_dht`` tries
again, with growing pauses, for as long as the caller will wait; any other failure to start is
raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hivemind import DHT
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from protocol.errors import BootstrapError

logger = logging.getLogger(__name__)

__all__ = ["FIRST_PAUSE_S", "LONGEST_PAUSE_S", "start_dht"]

FIRST_PAUSE_S = 1.0
"""The pause after the first refused start; each next one doubles, up to ``LONGEST_PAUSE_S``."""
LONGEST_PAUSE_S = 10.0
"""The longest pause between two starts: a restarted coordinator is joined within it."""
REAP_S = 10.0
"""How long a node whose daemon failed is given to exit before it is terminated."""


def start_dht(make: Callable[[], DHT], *, wait_s: float, sleep: Callable[[float], None] = time.sleep) -> DHT:
    """A started DHT node from ``make`` (which builds one, not started). While its daemon fails
    because no bootstrap peer answered, the failed node is reaped and a new one started, for up
    to ``wait_s`` seconds in all; then ``BootstrapError`` says so."""
    deadline = time.monotonic() + wait_s
    pause = FIRST_PAUSE_S
    while True:
        dht = make()
        try:
            dht.run_in_background(await_ready=True)
            return dht
        except P2PDaemonError as exc:
            _reap(dht)
            if "bootstrap" not in str(exc):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise BootstrapError(
                    f"none of the swarm's bootstrap peers answered within {wait_s:.0f} s: is the coordinator "
                    "(or every address of --initial-peers) up and reachable from this machine?"
                ) from exc
            logger.warning(
                "none of the swarm's bootstrap peers answered (is the coordinator restarting?): "
                "trying again in %.0f s, for up to %.0f s more",
                min(pause, left),
                left,
            )
            sleep(min(pause, left))
            pause = min(2 * pause, LONGEST_PAUSE_S)


def _reap(dht: DHT) -> None:
    """The failed node's process exits by itself once its daemon failed; reap it."""
    dht.join(REAP_S)
    if dht.is_alive():
        dht.terminate()
        dht.join(REAP_S)
