"""How the averaged vector is cut for parallel streams (``engine.fragments``)."""

from __future__ import annotations

import pytest

from engine.fragments import FRAGMENT_ALIGN, MIN_FRAGMENT_VALUES, fragment_bounds, fragment_group_id


@pytest.mark.parametrize("numel", [0, 1, 63, 5000, MIN_FRAGMENT_VALUES, 4 * MIN_FRAGMENT_VALUES + 1000, 10_400_017])
@pytest.mark.parametrize("streams", [1, 2, 3, 4, 8, 64])
def test_fragments_cover_the_vector_in_order_aligned(numel: int, streams: int) -> None:
    bounds = fragment_bounds(numel, streams)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
    assert all(start % FRAGMENT_ALIGN == 0 for start, _ in bounds)
    assert 1 <= len(bounds) <= streams
    if len(bounds) > 1:
        sizes = [end - start for start, end in bounds]
        assert min(sizes) >= MIN_FRAGMENT_VALUES - FRAGMENT_ALIGN
        assert max(sizes) - min(sizes) <= 2 * FRAGMENT_ALIGN


def test_small_vectors_are_cut_into_fewer_fragments() -> None:
    assert len(fragment_bounds(5000, 4)) == 1
    assert len(fragment_bounds(2 * MIN_FRAGMENT_VALUES + 5, 4)) == 2
    assert len(fragment_bounds(10_400_000, 4)) == 4


def test_the_cut_depends_only_on_the_vector_and_the_spec() -> None:
    assert fragment_bounds(10_400_017, 4) == fragment_bounds(10_400_017, 4)
    assert fragment_bounds(10_400_017, 4) != fragment_bounds(10_400_017, 2)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="streams >= 1"):
        fragment_bounds(100, 0)
    with pytest.raises(ValueError, match="numel >= 0"):
        fragment_bounds(-1, 2)
    with pytest.raises(ValueError, match="index"):
        fragment_group_id(b"g", -1)


def test_fragment_group_ids_are_distinct_and_fragment_0_is_the_group() -> None:
    ids = [fragment_group_id(b"group", index) for index in range(8)]
    assert ids[0] == b"group"
    assert len(set(ids)) == 8
