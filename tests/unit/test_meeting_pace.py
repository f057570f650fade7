"""An open-run newcomer's guess of where the swarm will be (``peer.pace.Sightings``): the pace
comes from when records first appeared, and rounds first seen in one lookup say nothing about
the time between them."""

from __future__ import annotations

from peer.pace import MAX_ROUNDS_AHEAD, PACE_ROUNDS, Sightings


def seen(lookups: list[tuple[float, range]]) -> Sightings:
    sightings = Sightings()
    for now, rounds in lookups:
        sightings.note(rounds, now)
    return sightings


def test_unknown_pace_meets_the_round_after() -> None:
    assert Sightings().rounds_ahead(10, now=100.0, lead_s=3.0) == 1
    assert seen([(50.0, range(8, 11))]).rounds_ahead(10, now=100.0, lead_s=3.0) == 1


def test_a_pace_seen_round_by_round() -> None:
    sightings = seen([(float(r), range(r + 1)) for r in range(20)])  # one round a second
    # round 19 was seen at 19 s; at 19 s, 3 s ahead: 3 more rounds, then the one after
    assert sightings.rounds_ahead(19, now=19.0, lead_s=3.0) == 4
    assert sightings.rounds_ahead(19, now=21.0, lead_s=3.0) == 6


def test_rounds_first_seen_together_do_not_make_the_swarm_look_faster() -> None:
    # one lookup (t = 0) returned rounds 20..30 at once, the next (t = 6) rounds 31..40: ten
    # rounds in 6 s, 0.6 s a round (counted from round 24, 16 below 40, it would be 0.375)
    sightings = seen([(0.0, range(20, 31)), (6.0, range(20, 41))])
    assert sightings.rounds_ahead(40, now=6.0, lead_s=3.0) == 1 + 5  # ceil(3 / 0.6)


def test_a_swarm_faster_than_the_lookups_still_has_a_pace() -> None:
    # between two attempts (6 s) a fast swarm landed 44 rounds, more than the pace window
    sightings = seen([(0.0, range(0, 4)), (6.0, range(0, 48))])
    assert sightings.rounds_ahead(47, now=6.0, lead_s=3.0) == 1 + 22  # 6 s / 44 rounds


def test_pruning_keeps_the_pace_and_never_sees_an_old_round_anew() -> None:
    sightings = seen([(float(t), range(0, 10 * (t + 1))) for t in range(10)])  # 10 rounds a second
    assert len(sightings.first_seen) <= 3 * PACE_ROUNDS
    sightings.note(range(0, 100), 50.0)  # the same records again, much later: nothing new
    assert 50.0 not in sightings.first_seen.values()
    assert sightings.rounds_ahead(99, now=9.0, lead_s=1.0) == 1 + 10


def test_the_guess_is_bounded() -> None:
    sightings = seen([(0.0, range(1)), (0.001, range(2))])
    assert sightings.rounds_ahead(1, now=100.0, lead_s=3.0) == 1 + MAX_ROUNDS_AHEAD
