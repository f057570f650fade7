"""Where an open run's newcomer meets the swarm (``Swarm._meeting_round``): its electorate is
empty, so it sees no agreed state to adopt, and it meets a later round the digest records show,
so that its first group (where it is stale, weight 0) is the evidence it re-syncs from
(docs/design/records.md, "Open runs")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from peer.swarm.swarm_pace import SwarmPace
from protocol.statesync import DigestRecord

logger = logging.getLogger(__name__)

DECLARATION_DELAY_S = 1.0
"""About how long a round's declaration takes to reach the peers that look it up in the DHT."""
PACE_LOOK_S = 1.0
"""An open-run newcomer that has seen the records only once looks again this much later, to
measure the swarm's pace before it aims (``Swarm._meeting_round``)."""


@dataclass(frozen=True)
class Meeting:
    """A round an open-run newcomer may meet the swarm at."""

    shown: int
    """The round a digest record showed."""
    meet: int
    """The round it meets at: past ``shown`` by as many as the swarm lands before it arrives."""
    pace: float | None
    """Seconds a round, as measured (None: unknown)."""


def meeting_candidates(records: Iterable[DigestRecord], round_: int, window: float, pace: SwarmPace) -> list[Meeting]:
    """The rounds to meet at, later than ``round_``: each round the records show (most signers
    first), met as many rounds past it as the swarm lands, at its measured ``pace``, before
    the newcomer's declaration is seen in the middle of its leader ``window``."""
    signers: dict[int, set[str]] = {}
    for record in records:
        if not record.archive and record.round > round_:
            signers.setdefault(record.round, set()).add(record.signer.id)
    ranked = sorted(signers, key=lambda later: (-len(signers[later]), -later))
    # aim at the middle of this peer's leader window, from when its declaration is seen to when
    # the window closes: a swarm up to half a window faster or slower than measured (a loaded
    # machine's swarm lands rounds unevenly) still arrives while it waits
    lead = max(DECLARATION_DELAY_S, (DECLARATION_DELAY_S + window) / 2)
    now, dht_now = time.monotonic(), get_dht_time()
    return [
        Meeting(later, later + pace.rounds_ahead(later, lead, now, dht_now), pace.seconds_per_round(later))
        for later in ranked
    ]


class Meetings:
    """An open-run newcomer's choice of the round it meets at, try after try
    (``Swarm._meeting_round``): anyone may sign records for any round, so it tries each round
    the records show in turn, those with the most signers first."""

    def __init__(self, pace: SwarmPace) -> None:
        self.pace = pace
        self.tries = 0

    def choose(self, round_: int, candidates: Callable[[], list[Meeting]]) -> int:
        """The round to meet at: ``round_`` itself when ``candidates`` (read now) are none. One
        look shows each member's current round, not how fast they move: a first look is taken
        again ``PACE_LOOK_S`` later."""
        found = candidates()
        if found and not self.pace.known(found[self.tries % len(found)].shown):
            time.sleep(PACE_LOOK_S)
            found = candidates()
        if not found:
            return round_
        meeting = found[self.tries % len(found)]
        self.tries += 1
        logger.info(
            "a newcomer to an open run: meeting the swarm at round %d (records show round %d, %s)",
            meeting.meet,
            meeting.shown,
            f"{meeting.pace:.2f} s a round" if meeting.pace is not None else "pace unknown",
        )
        return meeting.meet
