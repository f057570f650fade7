"""A relayed peer whose relays all left finds new ones, and the swarm follows, with no restart.

A relayed peer (``peer.net.network_path``) holds ports on up to ``RELAYS_HELD`` relays and announces
them: while one answers, others reach it there. When every one of its tunnels has had its control
connection down for ``LOST_AFTER_S`` (the relays' volunteers stopped, their machines vanished),
nobody can dial it: ``RelayKeeper`` asks the coordinator for the relays online now (a join
again: the answer lists volunteers' relays and the coordinator's own), opens ports on them
(``relay_client.open_several``), and moves the swarm there: the DHT node and the averager restart
with the new addresses under the same libp2p identity (``Swarm.move_to``; libp2p daemons cannot
change what they announce while they run), at the start of the peer's next round. Then
``moved`` publishes the membership again and points the puncher at the new daemon.

One line on the console says each step (``say``); with no other relay online it asks again,
waiting longer each time up to ``RETRY_S[1]``, and the peer trains on meanwhile (its rounds fail:
the watchdog counts them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from peer.net.announce import Announced
from peer.net.network_path import NetworkPath
from peer.net.relay_client import RelayAddress, RelayTunnel
from protocol.errors import SwarmtrainError

logger = logging.getLogger(__name__)

LOST_AFTER_S = 20.0
"""How long every tunnel's control connection must have been down before its relays count as
gone: a relay that restarts is back within seconds (the tunnel reopens it by itself, and the
relay keeps the port a minute), so a move, which costs the peer a round, waits this long."""
CHECK_S = 2.0
RETRY_S = (5.0, 10.0)
"""Pauses between asks while no other relay is online (a join each: a peer's heartbeat costs the
coordinator as much every few seconds), doubling up to the second: a relay that comes is used
within seconds, as the peer's rounds fail meanwhile."""
PUBLISH_S = 30.0
"""How long ``moved`` may retry publishing the membership record from the new DHT node, which
stores nothing until it has found other nodes."""
MOVE_WAIT_S = 600.0
"""The longest the keeper waits for the swarm to make the move (at its next round's start)."""


@dataclass(frozen=True)
class Found:
    """What the coordinator says now: the relays to try, in order, and a fresh access token."""

    relays: tuple[RelayAddress, ...]
    token: bytes


class RelayKeeper:
    """Watches a relayed peer's tunnels on its own thread (``start``/``close``); ``check`` is one
    step of it (see the module doc)."""

    def __init__(
        self,
        path: NetworkPath,
        *,
        find: Callable[[], Found],
        open_relays: Callable[[Sequence[RelayAddress], bytes], list[tuple[RelayTunnel, RelayAddress]]],
        move: Callable[[dict[str, object]], threading.Event],
        moved: Callable[[], None],
        say: Callable[[str], None],
        lost_after_s: float = LOST_AFTER_S,
        check_s: float = CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.find, self.open_relays, self.move, self.moved = path, find, open_relays, move, moved
        self.say, self.lost_after_s, self.check_s, self.clock = say, lost_after_s, check_s, clock
        self.moves = 0
        """How many times the swarm moved to new relays."""
        self._pause = RETRY_S[0]
        self._next_try = 0.0
        self._said_lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="relay-keeper")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.check()
            except Exception:  # the keeper must outlive one bad step
                logger.warning("relay keeper: a check failed", exc_info=True)

    def lost(self) -> bool:
        """Whether every tunnel's control connection has been down ``lost_after_s`` or longer."""
        now = self.clock()
        downs = [tunnel.down_since for tunnel in self.path.tunnels]
        return bool(downs) and all(d is not None and now - d >= self.lost_after_s for d in downs)

    def check(self) -> bool:
        """One step: True when it moved the swarm to new relays (and the swarm runs there)."""
        if self.path.kind != "relayed" or not self.lost():
            self._said_lost, self._pause = False, RETRY_S[0]
            return False
        if self.clock() < self._next_try:
            return False
        gone = {tunnel.relay.host for tunnel in self.path.tunnels}
        if not self._said_lost:
            self._said_lost = True
            self.say(
                f"network: the {len(gone)} relays this peer was reached at are gone "
                f"({', '.join(sorted(gone))}); asking the coordinator for others"
            )
        try:
            found = self.find()
            candidates = [relay for relay in found.relays if relay.host not in gone]
            held = self.open_relays(candidates, found.token) if candidates else []
        except SwarmtrainError as exc:
            return self._later(f"no new relay yet: {exc}")
        if not held:
            return self._later("no other relay is online")
        return self._move_to(held)

    def _later(self, why: str) -> bool:
        self.say(f"network: {why}; asking again in {self._pause:.0f} s (training goes on, its rounds fail)")
        self._next_try = self.clock() + self._pause
        self._pause = min(self._pause * 2, RETRY_S[1])
        return False

    def _move_to(self, held: list[tuple[RelayTunnel, RelayAddress]]) -> bool:
        announced = tuple(Announced(host=relay.host, port=tunnel.port, source=relay.whose) for tunnel, relay in held)
        for tunnel in self.path.tunnels:
            tunnel.close()
        why = f"its relays left; a port on {' and '.join(relay.whose for _, relay in held)}"
        self.path.relayed_again(announced, tuple(tunnel for tunnel, _ in held), why)
        done = self.move(self.path.dht_kwargs or {})
        end = self.clock() + MOVE_WAIT_S
        while not done.wait(0.5):
            if self._stop.is_set() or self.clock() > end:
                return False
        self.moves += 1
        self.moved()
        self.say(f"network: {self.path.describe()}")
        self._said_lost, self._pause, self._next_try = False, RETRY_S[0], 0.0
        return True
