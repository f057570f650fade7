"""A round's deadlines stretched to its slowest member's link.

A peer's averaging deadlines follow what its rounds took (``peer.round.timeouts``): in a swarm on fast
links they shrink to a few seconds, which cuts off a member on a link 10x slower mid-part (its
reducers stop waiting for its first part, it stops waiting for theirs) although it is alive and
sending. Every member states the bytes a second its link carries (``Gathered.link``: measured
from its state download), so every member of a group computes the same stretched deadlines from
what the group gathered: long enough for the slowest stated link to carry what may be ahead of a
part and the part to each reducer (the wait for a sender's next part), that and the averaged parts back (the
wait for a reducer),
and its whole share both ways (the round), each at most ``CAP`` times the peer's own deadline, so
a member that understates its link gains at most what a member that slow would get.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CAP = 4.0
"""A stretched deadline is at most this many times the peer's own."""
QUEUE_BYTES = 64 * 1024
"""What may be ahead of a member's first part on its link, in bytes: the group's start message
and the member's other traffic on the same connections (DHT lookups, records, update
downloads), a router's or a shaper's buffer. The slow-join lab's newcomer sent 2 kB parts (0.6 s
for all of them at its 21 kB/s), yet a reducer gave up on it 2.5 s after the round began: at that
rate 64 KiB is 3 s more."""
SLACK = 1.5
"""Transfer times are multiplied by this (a stated rate is a measurement, not a promise)."""
MARGIN_S = 1.0


@dataclass(frozen=True)
class RoundTimeouts:
    sender_s: float
    """How long a reducer waits for a sender's next part."""
    reducer_s: float
    """How long a sender waits for a reducer's next averaged part (and a reducer to serve it)."""
    allreduce_s: float
    """The whole all-reduce."""


def stretched(
    links: Iterable[float | None],
    *,
    part_bytes: int,
    vector_bytes: int,
    group_size: int,
    streams: int,
    base: RoundTimeouts,
) -> RoundTimeouts:
    """``base`` stretched to the slowest of ``links`` (bytes a second; None: unstated) for a group
    of ``group_size`` averaging ``vector_bytes`` on the wire in parts of ``part_bytes``, over
    ``streams`` concurrent all-reduces (fragments)."""
    stated = [link for link in links if link is not None and link > 0]
    if not stated or group_size < 2:
        return base
    slowest = min(stated)
    others = group_size - 1
    # its next part to every reducer at once, behind what its link's queue may hold
    one_part = (part_bytes * others * streams + QUEUE_BYTES) / slowest
    share = 2 * vector_bytes * others / group_size / slowest  # its share out, the averages back
    sender = _within(SLACK * one_part + MARGIN_S, base.sender_s)
    reducer = _within(sender + SLACK * one_part + MARGIN_S, base.reducer_s)
    whole = _within(SLACK * share + reducer + MARGIN_S, base.allreduce_s)
    return RoundTimeouts(sender, reducer, whole)


def _within(wanted: float, own: float) -> float:
    return min(max(wanted, own), CAP * own)
