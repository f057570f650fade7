"""``engine.link_timeouts``: a round's deadlines stretched to its slowest stated link, never
beyond ``CAP`` times a peer's own, and the ``link`` a member gathers read within bounds."""

from __future__ import annotations

import math

import pytest

from engine.link_timeouts import CAP, QUEUE_BYTES, RoundTimeouts, stretched
from protocol.gathered import MAX_LINK, MIN_LINK, Gathered

BASE = RoundTimeouts(sender_s=2.5, reducer_s=5.0, allreduce_s=7.5)
SHAPE = {"part_bytes": 2176, "vector_bytes": 17_125, "group_size": 4, "streams": 2}
"""The slow-join lab at density 1/4: the demo's 137K values at 1/8 byte each, two fragments."""


def test_a_group_of_fast_or_unstated_links_keeps_its_own_deadlines() -> None:
    assert stretched([None, None], **SHAPE, base=BASE) == BASE
    assert stretched([1e9, 5e8, None], **SHAPE, base=BASE) == BASE
    assert stretched([2e4], **{**SHAPE, "group_size": 1}, base=BASE) == BASE


def test_a_member_on_a_slow_link_gets_the_time_its_parts_take() -> None:
    # the slow-join lab's newcomer: 1.1 MB state in 52.8 s, ~21 kB/s, a 4-member group
    link = 21_000.0
    t = stretched([1e9, 1e9, 1e9, link], **SHAPE, base=BASE)
    # one part to each of 3 reducers on both fragments at once, behind a queue a home link holds:
    # its reducers gave up on it 2.5 s into the round when the parts alone would take 0.6 s
    first_parts = (SHAPE["part_bytes"] * 3 * 2 + QUEUE_BYTES) / link
    assert t.sender_s > first_parts > 2.5 and t.sender_s > BASE.sender_s
    assert t.reducer_s > t.sender_s + first_parts
    share_both_ways = 2 * SHAPE["vector_bytes"] * 3 / 4 / link
    assert t.allreduce_s > share_both_ways + t.reducer_s
    assert t.allreduce_s <= CAP * BASE.allreduce_s


def test_an_understated_link_makes_a_group_wait_no_longer_than_the_cap() -> None:
    liar = stretched([1e9, MIN_LINK], **SHAPE, base=BASE)
    assert liar == RoundTimeouts(CAP * BASE.sender_s, CAP * BASE.reducer_s, CAP * BASE.allreduce_s)
    assert liar.reducer_s > liar.sender_s  # hivemind's rule holds at the cap too


@pytest.mark.parametrize(
    ("stated", "read"),
    [(21_000.0, 21_000.0), (21_000, 21_000.0), (MIN_LINK / 2, None), (MAX_LINK * 2, None), (math.nan, None),
     (math.inf, None), (True, None), ("fast", None), (None, None), (-5.0, None)],
)  # fmt: skip
def test_a_gathered_link_is_read_within_bounds(stated: object, read: float | None) -> None:
    wire = {**Gathered(id="x", round=3, digest="d").to_wire(), "link": stated}
    parsed = Gathered.parse(wire)
    assert parsed is not None and parsed.link == read
    again = Gathered.parse(Gathered(id="x", link=21_000.0).to_wire())
    assert again is not None and again.link == 21_000.0
    assert "link" not in Gathered(id="x").to_wire()  # unmeasured: not stated
