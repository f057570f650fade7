"""``peer.task.data_assignment``: a keyed permutation per epoch; disjoint streams and rounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.task.data_assignment import DataAssignment, ids_digest, permute


@given(size=st.integers(1, 3000), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 50))
@settings(max_examples=40, deadline=None)
def test_permute_is_a_permutation_of_every_size(size: int, seed: int, epoch: int) -> None:
    assert sorted(permute(i, size, key=(seed, epoch)) for i in range(size)) == list(range(size))


def test_the_order_depends_on_seed_and_epoch_and_nothing_else() -> None:
    order = [permute(i, 1000, key=(7, 0)) for i in range(1000)]
    assert order == [permute(i, 1000, key=(7, 0)) for i in range(1000)]
    assert order != [permute(i, 1000, key=(7, 1)) for i in range(1000)]
    assert order != [permute(i, 1000, key=(8, 0)) for i in range(1000)]
    # pinned: the same ids on every machine and Python (BLAKE2b and integer arithmetic only)
    assert order[:5] == [permute(i, 1000, key=(7, 0)) for i in range(5)]
    assert ids_digest([1, 2, 3]) == ids_digest([1, 2, 3]) != ids_digest([3, 2, 1])
    assert len(ids_digest([])) == 32


def test_no_two_streams_share_a_sequence_in_a_round_and_an_epoch_covers_everything_once() -> None:
    a = DataAssignment(sequences=4 * 5 * 8 * 3, slots=4, steps=5, batch=8, seed=11)
    assert a.round_fits_epoch()
    seen: list[int] = []
    for round_ in range(3):  # three rounds = one epoch exactly
        per_stream = [
            {i for step in range(a.steps) for i in a.batch_ids(round_, slot, step)} for slot in range(a.slots)
        ]
        assert sum(len(s) for s in per_stream) == len(set().union(*per_stream)) == a.slots * a.page
        seen += [i for s in per_stream for i in s]
    assert sorted(seen) == list(range(a.sequences))
    assert a.epoch(3) == 1.0
    # the next epoch visits everything again, in another order
    next_epoch = [i for step in range(a.steps) for i in a.batch_ids(3, 0, step)]
    assert next_epoch != [i for step in range(a.steps) for i in a.batch_ids(0, 0, step)]


@given(
    sequences=st.integers(1, 400),
    slots=st.integers(1, 5),
    steps=st.integers(1, 4),
    batch=st.integers(1, 4),
    rounds=st.integers(1, 12),
)
@settings(max_examples=60, deadline=None)
def test_rounds_never_straddle_epochs_whatever_the_sizes(
    sequences: int, slots: int, steps: int, batch: int, rounds: int
) -> None:
    a = DataAssignment(sequences=sequences, slots=slots, steps=steps, batch=batch, seed=3)
    if not a.round_fits_epoch():
        with pytest.raises(ValueError, match="more than the"):
            a.batch_ids(0, 0, 0)
        return
    per_epoch: dict[int, list[int]] = {}
    for round_ in range(rounds):
        ids = [i for slot in range(slots) for step in range(steps) for i in a.batch_ids(round_, slot, step)]
        assert len(ids) == len(set(ids))  # no two streams (or steps) share a sequence in a round
        per_epoch.setdefault(round_ // a.rounds_per_epoch, []).extend(ids)
    for ids in per_epoch.values():
        assert len(ids) == len(set(ids))  # nor is any sequence trained twice in an epoch


def test_the_collision_a_straddling_round_would_have() -> None:
    # 10 sequences, 4 streams of 2: a round reads 8; the old order (epoch = position // N) put
    # round 1's positions 8..15 across two epochs and gave streams 0 and 1 the same sequence
    a = DataAssignment(sequences=10, slots=4, steps=1, batch=2, seed=0)
    assert a.rounds_per_epoch == 1
    for round_ in range(6):
        ids = [i for slot in range(4) for i in a.batch_ids(round_, slot, 0)]
        assert len(set(ids)) == 8


def test_out_of_range_samples_and_bad_sizes_are_refused() -> None:
    a = DataAssignment(sequences=100, slots=2, steps=2, batch=4, seed=0)
    for bad in ((0, 2, 0, 0), (0, 0, 2, 0), (0, 0, 0, 4), (-1, 0, 0, 0)):
        with pytest.raises(ValueError, match="no sample"):
            a.position(*bad)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        DataAssignment(sequences=100, slots=0, steps=2, batch=4, seed=0)
    assert not DataAssignment(sequences=10, slots=2, steps=2, batch=4, seed=0).round_fits_epoch()
    with pytest.raises(ValueError):
        permute(10, 10, key=(0, 0))


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    slots=st.integers(1, 4),
    steps=st.integers(1, 4),
    batch=st.integers(1, 4),
)
@settings(max_examples=60, deadline=None)
def test_with_shards_an_epoch_is_still_a_permutation_and_a_page_reads_only_its_shards(
    sizes: list[int], slots: int, steps: int, batch: int
) -> None:
    a = DataAssignment(sequences=sum(sizes), slots=slots, steps=steps, batch=batch, seed=5, shards=tuple(sizes))
    if not a.round_fits_epoch():
        return
    starts = [sum(sizes[:t]) for t in range(len(sizes))]
    shard_of = {seq: t for t, start in enumerate(starts) for seq in range(start, start + sizes[t])}
    for epoch in range(2):
        seen = []
        for q in range(a.rounds_per_epoch):
            round_ = epoch * a.rounds_per_epoch + q
            for slot in range(slots):
                ids = [i for step in range(steps) for i in a.batch_ids(round_, slot, step)]
                assert {shard_of[i] for i in ids} <= set(a.page_shards(round_, slot))
                seen += ids
        assert len(seen) == len(set(seen))  # at most once per epoch
        full = sorted(a.sequence(epoch, p) for p in range(a.sequences))
        assert full == list(range(a.sequences))  # the epoch's order is a permutation


def test_a_page_reads_few_shards_and_each_batch_mixes_them() -> None:
    # 64 shards of 100 sequences, pages of 20 steps x 10 = 200 sequences: about 2-3 shards a page
    a = DataAssignment(sequences=6400, slots=4, steps=20, batch=10, seed=1, shards=(100,) * 64)
    for round_ in range(3):
        for slot in range(4):
            touched = a.page_shards(round_, slot)
            assert 2 <= len(touched) <= 3
            batch = a.batch_ids(round_, slot, 0)
            assert len({i // 100 for i in batch}) >= 2  # a batch is not one shard's rows
    # every epoch its own shard order
    assert [a.page_shards(0, s) for s in range(4)] != [a.page_shards(a.rounds_per_epoch, s) for s in range(4)]
    with pytest.raises(ValueError, match="add up to"):
        DataAssignment(sequences=10, slots=1, steps=1, batch=1, seed=0, shards=(4, 5))
