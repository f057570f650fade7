"""The swarm's pace as a newcomer measures it from its looks at the digest records
(``peer.swarm.swarm_pace``): the DHT shows each member's latest round only."""

from __future__ import annotations

from peer.swarm.swarm_pace import MAX_ROUNDS_AHEAD, PACE_HORIZON_S, LandingTimes, SwarmPace, landing_medians


def test_one_look_gives_no_pace_however_many_rounds_it_shows() -> None:
    pace = SwarmPace()
    pace.saw({40, 41, 42}, now=10.0)  # three members at three rounds, one look
    assert pace.seconds_per_round(42) is None and not pace.known(42)
    assert pace.rounds_ahead(42, lead_s=5.0, now=10.0) == 1


def test_two_looks_measure_the_pace_between_them_even_when_many_rounds_passed() -> None:
    """A fast swarm moves tens of rounds between two looks: the rounds between were never shown
    (the bug this replaced measured only over the 16 rounds below the one shown, all first seen
    in the same look, so a newcomer always aimed one round ahead and missed the swarm)."""
    pace = SwarmPace()
    pace.saw({9, 10}, now=0.0)
    pace.saw({49, 50}, now=10.0)
    assert pace.seconds_per_round(50) == 10.0 / 40
    # 5 s after the look plus a 6 s lead at 40 rounds per 10 s: 44 rounds, +1
    assert pace.rounds_ahead(50, lead_s=6.0, now=15.0) == 1 + 44


def test_two_looks_a_moment_apart_give_no_pace() -> None:
    pace = SwarmPace()
    pace.saw({45}, now=10.0)
    pace.saw({46}, now=10.01)  # the trainer's and the launch's looks: 10 ms apart
    assert not pace.known(46) and pace.rounds_ahead(46, lead_s=5.0, now=10.02) == 1
    pace.saw({52}, now=11.0)
    assert pace.seconds_per_round(52) == (11.0 - 10.01) / 6


def test_a_dead_members_old_round_does_not_count_as_rounds_the_swarm_landed() -> None:
    """A member killed at round 2 keeps its record of round 2 in the DHT: a newcomer that
    measured from it counted 148 rounds in the second between two looks, aimed 65 rounds past a
    swarm at 0.6 s a round and met nobody (the suite's late joiner, three times in a row)."""
    pace = SwarmPace()
    pace.saw({2, 150}, now=0.0)
    pace.saw({2, 152}, now=1.2)
    assert pace.seconds_per_round(152) == 0.6
    assert pace.rounds_ahead(152, lead_s=3.0, now=1.2) == 1 + 5


def test_the_signed_landing_times_give_the_pace_whatever_the_lookups_lag() -> None:
    """Two looks 4 s apart (a home link's slow lookups) that show rounds landed 1 s a round: the
    sightings say 2 s a round, the landing times the truth; and the time since the round shown
    landed counts, not only since this peer first saw it."""
    pace = SwarmPace()
    pace.saw({10}, now=0.0, landed={10: 1000.0})
    pace.saw({12}, now=4.0, landed={12: 1002.0})
    assert pace.seconds_per_round(12) == 1.0
    # landed 3 s before this look (dht 1005), 2 s lead: 5 rounds, +1
    assert pace.rounds_ahead(12, lead_s=2.0, now=4.0, dht_now=1005.0) == 1 + 5
    # a clock behind the swarm's never aims short of what the sightings say
    assert pace.rounds_ahead(12, lead_s=2.0, now=4.0, dht_now=900.0) == 1 + 2


def test_a_looks_landing_time_is_the_median_of_its_records() -> None:
    from protocol.identity import Identity
    from protocol.statesync import DigestRecord

    def record(round_: int, landed: float | None, *, archive: bool = False) -> DigestRecord:
        return DigestRecord(Identity.generate().public_key, round_, "blake3:" + "0" * 64, archive, landed=landed)

    records = [record(5, 10.0), record(5, 11.0), record(5, 900.0), record(5, None), record(6, 0.0, archive=True)]
    assert landing_medians(records) == {5: 11.0}


def test_landing_times_are_forgotten_with_their_sightings() -> None:
    pace = SwarmPace()
    pace.saw({1}, now=0.0, landed={1: 50.0, 99: 60.0})  # a time for a round not shown is ignored
    assert pace.landed == {1: 50.0}
    pace.saw({2}, now=PACE_HORIZON_S + 1, landed={2: 200.0})
    assert pace.landed == {2: 200.0} and pace.seconds_per_round(2) is None


def test_a_slow_swarm_is_aimed_at_the_round_after_the_one_shown() -> None:
    pace = SwarmPace()
    pace.saw({3}, now=0.0)
    pace.saw({4}, now=120.0)  # two minutes a round
    assert pace.rounds_ahead(4, lead_s=5.0, now=121.0) == 2


def test_a_forged_round_far_ahead_is_aimed_at_no_further_than_the_cap() -> None:
    pace = SwarmPace()
    pace.saw({10}, now=0.0)
    pace.saw({11, 1_000_000}, now=1.0)
    assert pace.rounds_ahead(1_000_000, lead_s=5.0, now=1.0) == 1 + MAX_ROUNDS_AHEAD
    assert pace.rounds_ahead(11, lead_s=5.0, now=1.0) == 1 + 5


def test_old_sightings_are_forgotten_and_the_memory_is_bounded() -> None:
    pace = SwarmPace()
    pace.saw({1}, now=0.0)
    pace.saw({2}, now=PACE_HORIZON_S + 1)
    assert 1 not in pace.first_seen and pace.seconds_per_round(2) is None
    pace.saw(set(range(10_000, 20_000)), now=PACE_HORIZON_S + 2)  # anyone may sign any round
    assert len(pace.first_seen) == 256


def test_a_round_is_first_seen_once() -> None:
    pace = SwarmPace()
    pace.saw({5}, now=1.0)
    pace.saw({5, 6}, now=3.0)
    assert pace.first_seen == {5: 1.0, 6: 3.0} and pace.seconds_per_round(6) == 2.0


def test_a_rounds_landing_time_is_the_median_its_members_signed() -> None:
    """One member's skewed clock (or lie) moves a newcomer's timing by no more than the spread
    of the others'; archives and adopters (no landing time) say nothing, and strangers' records
    (signers whose votes do not count) neither move a round's time nor push real rounds out."""
    from protocol.identity import Identity
    from protocol.statesync import DigestRecord

    def record(round_: int, landed: float | None, *, archive: bool = False) -> DigestRecord:
        return DigestRecord(Identity.generate().public_key, round_, "blake3:" + "0" * 64, archive, landed=landed)

    times = LandingTimes()
    members = [record(7, 100.0), record(7, 101.0), record(7, 5_000.0), record(7, None), record(7, 0.0, archive=True)]
    eligible = {r.signer.id for r in members}.__contains__
    times.saw(members, eligible)
    assert times.at(7) == 101.0
    assert times.at(8) is None
    times.saw([record(8, None)], eligible)
    assert times.at(8) is None
    # strangers (keys are free) sign many records: for a real round, and for rounds far ahead
    strangers = [record(7, 9_999.0) for _ in range(50)] + [record(10**6 + n, 1.0) for n in range(300)]
    times.saw(strangers, eligible)
    assert times.at(7) == 101.0 and times.at(10**6) is None
