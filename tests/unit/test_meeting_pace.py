"""An open-run newcomer's guess of where the swarm will be (``peer.swarm.rounds_ahead``): the
pace comes from when records first appeared, and rounds first seen in one lookup say nothing
about the time between them."""

from __future__ import annotations

from peer.swarm import MAX_ROUNDS_AHEAD, rounds_ahead


def test_unknown_pace_meets_the_round_after() -> None:
    assert rounds_ahead({}, 10, now=100.0, lead_s=3.0) == 1
    assert rounds_ahead({8: 50.0, 9: 50.0, 10: 50.0}, 10, now=100.0, lead_s=3.0) == 1


def test_a_pace_seen_round_by_round() -> None:
    sightings = {r: float(r) for r in range(20)}  # one round a second, each seen as it landed
    # round 19 was seen at 19 s; at 19 s, 3 s ahead: 3 more rounds, then the one after
    assert rounds_ahead(sightings, 19, now=19.0, lead_s=3.0) == 4
    assert rounds_ahead(sightings, 19, now=21.0, lead_s=3.0) == 6


def test_rounds_first_seen_together_do_not_make_the_swarm_look_faster() -> None:
    # the first lookup (t = 0) returned rounds 20..30 at once; the next (t = 6) rounds 31..40:
    # ten rounds in 6 s, 0.6 s a round (counting from round 24, 16 below 40, it would be 0.375)
    sightings = {r: 0.0 for r in range(20, 31)} | {r: 6.0 for r in range(31, 41)}
    assert rounds_ahead(sightings, 40, now=6.0, lead_s=3.0) == 1 + 5  # ceil(3 / 0.6)


def test_the_guess_is_bounded() -> None:
    sightings = {0: 0.0, 1: 0.001}
    assert rounds_ahead(sightings, 1, now=100.0, lead_s=3.0) == 1 + MAX_ROUNDS_AHEAD
