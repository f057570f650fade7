"""The gates of fragments averaged in turn (``engine.sync_gates``) and the cut of the vector
into fragments in turn and at once (``engine.fragment_rounds.sync_layout``)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils.mpfuture import MPFuture

from engine.fragment_rounds import sync_layout
from engine.fragments import FRAGMENT_ALIGN, fragment_bounds
from engine.outcome import FragmentDone
from engine.sync_gates import KEPT_ROUNDS, SyncGates


@pytest.mark.parametrize("numel", [1, 70_000, 2**18, 3 * 2**17 + 123, 10**6])
@pytest.mark.parametrize(("in_turn", "streams"), [(1, 1), (1, 4), (3, 2), (4, 4), (8, 1)])
def test_the_layout_covers_the_vector_in_order_and_is_the_old_cut_with_one_fragment_in_turn(
    numel: int, in_turn: int, streams: int
) -> None:
    syncs, parts = sync_layout(numel, in_turn, streams)
    assert syncs == fragment_bounds(numel, in_turn)
    flat = [bounds for group in parts for bounds in group]
    assert flat[0][0] == 0 and flat[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    for (start, end), group in zip(syncs, parts):
        assert group[0][0] == start and group[-1][1] == end
        assert all(lo % FRAGMENT_ALIGN == 0 for lo, _ in group)  # every codec block starts aligned
    if in_turn == 1:
        assert flat == fragment_bounds(numel, streams)


def _answer() -> MPFuture[FragmentDone]:
    return MPFuture()


def test_a_gate_opened_before_its_wait_or_after_is_seen_and_answered_once() -> None:
    async def main() -> None:
        gates = SyncGates()
        early = _answer()
        gates.open(3, 0, early, 0, 10)
        assert await gates.wait(3, 0, timeout=0.01)
        waiting = asyncio.ensure_future(gates.wait(3, 1, timeout=5))
        await asyncio.sleep(0)
        assert not waiting.done()
        late = _answer()
        gates.open(3, 1, late, 10, 20)
        assert await asyncio.wait_for(waiting, 1)
        gates.answer(3, FragmentDone(0, 0, 10))
        assert early.result(timeout=1).averaged
        gates.answer(3, FragmentDone(0, 0, 10, failed="again"))  # a second answer changes nothing
        assert early.result(timeout=1).averaged
        assert not await gates.wait(3, 2, timeout=0.01)  # never opened: the wait ends on its timeout

    asyncio.run(main())


def test_a_gate_opened_twice_for_a_closed_round_or_an_old_round_is_answered_as_failed_at_once() -> None:
    async def main() -> None:
        gates = SyncGates()
        first = _answer()
        gates.open(5, 0, first, 0, 10)
        twice = _answer()
        gates.open(5, 0, twice, 0, 10)
        assert "twice" in twice.result(timeout=1).failed
        assert not first.done()
        gates.close(5, "the round found no group here", [(0, 10), (10, 20)])
        closed = first.result(timeout=1)
        assert closed.failed == "the round found no group here" and (closed.start, closed.end) == (0, 10)
        after = _answer()
        gates.open(5, 1, after, 10, 20)
        assert after.result(timeout=1).failed == "the round found no group here"
        older = _answer()
        gates.open(4, 0, older, 0, 10)  # a round before one that already ran here
        assert older.result(timeout=1).failed
        gates.begin(5)  # the same round sent again (its first try failed): its gates open anew
        again = _answer()
        gates.open(5, 0, again, 0, 10)
        assert not again.done() and await gates.wait(5, 0, timeout=0.01)

    asyncio.run(main())


def test_gates_of_rounds_long_over_are_answered_and_forgotten() -> None:
    async def main() -> None:
        gates = SyncGates()
        stale = _answer()
        gates.open(1, 0, stale, 0, 10)
        gates.open(1 + KEPT_ROUNDS + 1, 0, _answer(), 0, 10)
        assert stale.result(timeout=1).failed == "the round is long over"

    asyncio.run(main())
