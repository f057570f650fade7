"""The round loop's decisions (``peer.round.round_loop``), case by case: what a peer does next from
where its round is."""

from __future__ import annotations

import itertools

import pytest

from peer.round.round_loop import LoopView, Step, next_step, opens_inner, starts_averaging

# (inner, training, flight, due, leaving_out_of_sync) -> step
TABLE = [
    # nothing in flight
    ((True, True, False, False, False), Step.TRAIN),
    ((True, False, False, False, False), Step.LAUNCH),  # the phase is over: launch its round
    ((True, False, False, False, True), Step.DISCARD),  # ... unless leaving out of sync
    ((True, True, False, False, True), Step.TRAIN),  # a stop ends the phase (training False), not the step
    ((False, False, False, False, False), Step.END),
    ((False, False, False, False, True), Step.END),
    # a round in flight (overlap: the next phase trains meanwhile)
    ((True, True, True, False, False), Step.TRAIN),  # averaging goes on beside the steps
    ((True, True, True, True, False), Step.LAND),  # due: it lands between two inner steps
    ((True, False, True, False, False), Step.LAND),  # the phase is over first: wait for the round
    ((True, False, True, True, False), Step.LAND),  # a round lands before the next launch
    ((True, False, True, False, True), Step.LAND),
    ((False, False, True, False, False), Step.LAND),  # no overlap: wait for it
    ((False, False, True, True, False), Step.LAND),
    # leaving out of sync changes nothing while a round is in flight: it lands (or fails) first
    ((True, True, True, False, True), Step.TRAIN),
    ((True, True, True, True, True), Step.LAND),
    ((True, False, True, True, True), Step.LAND),
    ((False, False, True, False, True), Step.LAND),
    ((False, False, True, True, True), Step.LAND),
]


@pytest.mark.parametrize(("view", "step"), TABLE, ids=[f"{s.value}-{i}" for i, (_, s) in enumerate(TABLE)])
def test_the_next_step_of_each_state_of_the_loop(view: tuple[bool, bool, bool, bool, bool], step: Step) -> None:
    assert next_step(LoopView(*view)) is step


def test_the_table_covers_every_state_the_loop_can_be_in() -> None:
    possible = set()
    for view in itertools.product([False, True], repeat=5):
        inner, training, flight, due, _ = view
        if (training and not inner) or (due and not flight):
            with pytest.raises(AssertionError):
                LoopView(*view)
            continue
        possible.add(view)
    assert possible == {view for view, _ in TABLE}


def test_a_round_never_lands_nor_launches_while_the_phase_trains_and_nothing_is_due() -> None:
    for flight in (False, True):
        assert next_step(LoopView(True, True, flight, False, False)) is Step.TRAIN


@pytest.mark.parametrize(
    ("inner", "more", "flight", "overlap", "opens"),
    [
        (False, True, False, False, True),
        (False, True, False, True, True),
        (False, True, True, True, True),  # overlap: the next phase trains while the round averages
        (False, True, True, False, False),  # no overlap: one after the other
        (False, False, False, True, False),  # finished or told to stop
        (True, True, False, True, False),  # one phase at a time
    ],
)
def test_an_inner_phase_opens_only_beside_at_most_one_round_and_only_with_overlap(
    inner: bool, more: bool, flight: bool, overlap: bool, opens: bool
) -> None:
    assert opens_inner(inner=inner, more=more, flight=flight, overlap=overlap) is opens


@pytest.mark.parametrize(
    ("writing", "written", "training", "starts"),
    [
        (False, False, True, False),  # written on the training thread: already started
        (True, False, True, False),  # still being written: train on
        (True, True, True, True),
        (True, False, False, True),  # nothing left to train: wait for the writer, then start
    ],
)
def test_a_round_written_off_thread_starts_averaging_when_written_or_when_nothing_trains(
    writing: bool, written: bool, training: bool, starts: bool
) -> None:
    assert starts_averaging(writing=writing, written=written, training=training) is starts
