"""A member killed after its round landed is credited in absentia through the coordinator's own
path (reports, tick, store, heartbeat), and a name in a group is no admission: a key the run
never admitted, or banned, is credited nothing however many members name it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from protocol.identity import Identity
from tests.unit.claim_calls import group, heartbeat, join, report
from tests.unit.conftest import new_core

SPEC = '[run]\nname = "absent"\n[credits]\nmax_samples_per_second = 100.0\n'
T0 = 1_800_000_000.0
SAMPLES = 40


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    made = new_core(tmp_path, SPEC)
    yield made
    made.store.close()


def _round(core: Coordinator, reporters: list[Identity], named: list[Identity], round_: int, now: float) -> None:
    for peer in reporters:
        report(
            core, peer, now, round=round_, samples=SAMPLES, compute_s=9.0, state_digest="d", group=group(named, SAMPLES)
        )


def test_a_member_killed_after_landing_is_credited_and_sees_it_when_back(core: Coordinator) -> None:
    members = [join(core, T0) for _ in range(4)]
    _round(core, members[:3], members, 3, T0 + 10)  # members[3] was SIGKILLed before reporting
    core.tick(now=T0 + 40)
    assert members[3].public_key.id not in core.store.credits_by_peer()  # not before finalisation
    core.tick(now=T0 + 71)
    credits = core.store.credits_by_peer()
    assert {k: credits[m.public_key.id].samples for k, m in enumerate(members)} == {0: 40, 1: 40, 2: 40, 3: 40}
    (claim,) = core.store.claims(key=members[3].public_key.id)
    assert "in absentia" in claim.reason and claim.status == "granted"
    # it comes back with its key: its heartbeat shows the credit, and its own late report changes nothing
    assert heartbeat(core, members[3], T0 + 80).credited_samples == SAMPLES
    late = report(
        core, members[3], T0 + 81, round=3, samples=SAMPLES, compute_s=9.0, state_digest="d", group=group(members, 99)
    )
    assert late.reason == "already reported"
    assert core.store.credits_by_peer()[members[3].public_key.id].samples == SAMPLES


def test_a_name_is_no_admission(core: Coordinator) -> None:
    """Three members name a key that never joined and one the operator banned, with a large
    weight: neither is credited, nor is anything recorded for them."""
    members = [join(core, T0) for _ in range(3)]
    banned = join(core, T0)
    core.ban(banned.public_key.id, "spam", now=T0 + 1)
    stranger = Identity.generate()
    _round(core, members, [*members, banned, stranger], 5, T0 + 10)
    core.tick(now=T0 + 71)
    credits = core.store.credits_by_peer()
    assert set(credits) == {m.public_key.id for m in members}
    assert core.store.claims(key=stranger.public_key.id) == core.store.claims(key=banned.public_key.id) == []


def test_reports_that_arrive_together_after_an_outage_are_credited_in_full(core: Coordinator) -> None:
    """A peer trains through a coordinator outage and its reports of three rounds arrive within
    milliseconds when the coordinator is back: each round took 9 s by the peer's word and the
    coordinator saw 40 s pass, so all three are credited. (Each report once drew the whole time
    since the last one: the second and third got a millisecond each, 0 samples at 100/s.)"""
    members = [join(core, T0) for _ in range(3)]
    for offset, round_ in ((40.0, 1), (40.001, 2), (40.002, 3)):
        _round(core, members, members, round_, T0 + offset)
    core.tick(now=T0 + 120)
    credits = core.store.credits_by_peer()
    assert {m.public_key.id: credits[m.public_key.id].samples for m in members} == {
        m.public_key.id: 3 * SAMPLES for m in members
    }


def test_a_backlog_draws_no_more_time_than_passed(core: Coordinator) -> None:
    """The clock bound is shared, not renewed: three reports 10 ms apart that each say a round
    took 9 s, from a peer seen 10 s ago, are credited together at most 100 samples/s x 10 s."""
    members = [join(core, T0) for _ in range(3)]
    for offset, round_ in ((10.0, 1), (10.01, 2), (10.02, 3)):
        for peer in members:
            report(
                core,
                peer,
                T0 + offset,
                round=round_,
                samples=900,
                compute_s=9.0,
                state_digest="d",
                group=group(members, 900),
            )
    core.tick(now=T0 + 120)
    credits = core.store.credits_by_peer()
    assert all(credits[m.public_key.id].samples <= 100 * 10.02 for m in members)
    assert all(credits[m.public_key.id].samples >= 100 * 10.0 for m in members)
