"""This peer's digest record in the DHT (``protocol.statesync``): the state it holds, signed,
re-signed while rounds run, and marked ``leaving`` when it stops cleanly. It claims the state's
roster size only if the peer is in that roster (``RosterBook.known``)."""

from __future__ import annotations

import logging
import time

from peer.round.roster_book import RosterBook
from peer.round.swarm_port import SwarmPort
from protocol.identity import Identity
from protocol.statesync import RECORD_TTL_S

logger = logging.getLogger(__name__)

REPUBLISH_S = RECORD_TTL_S / 4
"""A peer re-signs its digest record this often while a round runs, so that rounds longer than
the record's lifetime never leave newcomers without votes."""


class DigestPublisher:
    """Publishes (``publish``), re-signs (``republish``) and, at a clean stop, marks
    (``say_leaving``) the record of the state this peer serves. ``snapshot``: (round, digest,
    landed) of that state, ``landed`` being when the peer landed it by averaging (wall clock;
    None when adopted); ``published_at``: when it was last signed (monotonic)."""

    def __init__(
        self, swarm: SwarmPort, identity: Identity, roster: RosterBook, snapshot: tuple[int, str, float | None]
    ) -> None:
        self.swarm, self.identity, self.roster = swarm, identity, roster
        self.snapshot = snapshot
        self.published_at = time.monotonic()

    def publish(self, round_: int, digest: str, landed: float | None = None) -> None:
        """Publish the record of the state of ``round_`` (``digest``)."""
        self.snapshot = (round_, digest, landed)
        self.republish()

    def landed_at(self, round_: int, digest: str) -> float | None:
        """When this peer landed the state of ``round_`` by averaging, if that is the state it serves."""
        return self.snapshot[2] if self.snapshot[:2] == (round_, digest) else None

    def say_leaving(self) -> None:
        """This peer stops cleanly: mark its last digest record ``leaving`` (signed), so that the
        next round's leader, which counts it in the roster of this state, need not wait for it
        (``engine.matchmaking.RoundMatchmaking``). Its vote for the state stands."""
        round_, digest, landed = self.snapshot
        self.swarm.publish_digest(
            self.identity, round_=round_, digest=digest, roster=self.claimed_roster(), leaving=True, landed=landed
        )
        logger.info("said in the DHT that this peer leaves holding round %d's state", round_)

    def claimed_roster(self) -> int:
        """The roster size this peer's digest record claims for its state: its roster's, if it is
        in that roster (it landed the state, or its group did: ``RosterBook.known``), else 0. A
        peer that only adopted the state still gathers the size its holders published (so that
        a group of adopters cannot land beside the roster's own), but its record says nothing:
        adopters that re-published it kept a roster alive after its members were gone. The soak
        met it: a pair landed a round and was killed and restarted over and over; every newcomer
        adopted the pair's claim from the records and published it again, so each later
        newcomer learnt it too, and no group of them ever passed the rule (no round landed for
        nine minutes, until the run was stopped)."""
        return self.roster.size if self.roster.known else 0

    def republish(self) -> None:
        """Sign and store the served state's digest record again (no new digest computed)."""
        round_, digest, landed = self.snapshot
        self.swarm.publish_digest(
            self.identity, round_=round_, digest=digest, roster=self.claimed_roster(), landed=landed
        )
        self.published_at = time.monotonic()

    def republish_if_due(self) -> None:
        """Re-sign the record if ``REPUBLISH_S`` passed since it was last signed (between inner steps)."""
        if time.monotonic() - self.published_at >= REPUBLISH_S:
            self.republish()
