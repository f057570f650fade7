"""What the trainer's round loop does next: a pure function of where its round is.

A peer holds at most one open inner phase (the steps of the round it trains) and one round in
flight (launched, averaging or landing); with overlap both at once, else one after the other.
``Trainer._rounds`` asks ``next_step`` once per turn and does what it says; the table in
``tests/unit/test_round_loop.py`` is the loop's whole behaviour.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Step(enum.Enum):
    """One turn of the round loop."""

    TRAIN = "train"
    """One inner step (the round in flight, if any, averages meanwhile)."""
    LAND = "land"
    """Land the round in flight: wait for it when nothing is left to train; with overlap, a
    landing whose host half still runs lets the inner steps go on (``Trainer._land``)."""
    LAUNCH = "launch"
    """The inner phase is over: turn its work into the next round's pseudo-gradient and launch it."""
    DISCARD = "discard"
    """The inner phase is over but the peer leaves out of sync (its re-sync was cut short): a
    round from a state the swarm has left would count for nothing, so none is launched."""
    END = "end"
    """Nothing open and nothing in flight: the run is over for this peer."""


@dataclass(frozen=True)
class LoopView:
    """Where the round loop stands at the start of a turn."""

    inner: bool
    """An inner phase is open."""
    training: bool
    """... and has steps left (not out of steps or time, and no stop asked)."""
    flight: bool
    """A round is launched and has not landed."""
    due: bool
    """... and its result, and its landing's host half if one runs, are ready."""
    leaving_out_of_sync: bool
    """A stop was asked while this peer is out of sync."""

    def __post_init__(self) -> None:
        assert not self.training or self.inner, "training needs an open inner phase"
        assert not self.due or self.flight, "only a round in flight can be due"


def opens_inner(*, inner: bool, more: bool, flight: bool, overlap: bool) -> bool:
    """Whether to open an inner phase now: none is open, more rounds are wanted, and nothing is
    in flight unless the rounds overlap (then the next phase trains while the last round averages)."""
    return not inner and more and (not flight or overlap)


def starts_averaging(*, writing: bool, written: bool, training: bool) -> bool:
    """Whether to start a launched round's averaging now: its pseudo-gradient, written on the
    landing thread, is ready, or nothing is left to train while it is written (then wait for it)."""
    return writing and (written or not training)


def next_step(view: LoopView) -> Step:
    """The loop's next step: land a round that is due, or whose inner phase has nothing left
    to train beside it; else train; else launch (or discard) the finished inner phase; else end."""
    if view.flight and (not view.training or view.due):
        return Step.LAND
    if view.training:
        return Step.TRAIN
    if view.inner:
        return Step.DISCARD if view.leaving_out_of_sync else Step.LAUNCH
    return Step.END
