"""Who trains on what: the disjoint, deterministic data assignment of a token run.

The prepared training data is ``N`` sequences in shards (``protocol.manifest``). The run has
``S = data.slots`` data streams; the coordinator gives each peer's GPUs their streams (a node
of W GPUs holds W consecutive ones). A round reads ``S`` *pages* of ``P = H x B`` sequences
(H inner steps of B sequences), one per stream; an epoch is ``R = N // (S x P)`` whole
rounds (the ``N - R x S x P`` sequences left over sit out that epoch, other ones each epoch).
In round ``r`` (epoch ``e = r // R``, round ``q = r mod R`` of it) stream ``k`` trains page
``q x S + k``: positions ``[(q x S + k) x P, (q x S + k + 1) x P)`` of epoch ``e``'s order. Sample
``i`` of step ``s`` is the page's offset ``o = (s x B + i) x c mod P`` (``c``, the smallest stride
>= H coprime to P, spreads each batch over the whole page), and a position is a sequence by
two keyed pseudo-random permutations (``permute``: a Feistel network over the next power of four,
cycle-walked into range), keyed by the run's data seed and the epoch:

    the shards of the training split, in the epoch's shard order, laid end to end; position p
    falls in shard t at row j of it; the sequence is shard t's row permute_e,t(j).

So a page reads a run of whole shards (and parts of the two at its ends): a peer needs only
the shards of its own pages, fetched ahead of them (``peer.task.fetch``), while each batch
mixes rows of every shard of the page, in a fresh order each epoch. Each epoch still visits
each sequence at most once, and distinct (round, stream, step, i) of an epoch are distinct
positions, hence distinct sequences: no two streams ever train the same sequence in the same
round, and none is trained twice in an epoch. A round never straddles two epochs (whose orders
are unrelated). It needs ``S x P <= N`` (checked when the task is built). Prepared shards of a
few thousand sequences keep what a page fetches near what it trains.

Anyone holding the spec and the manifest recomputes who trained what from (run, round,
stream): a peer reports the digest of the sequence ids it read (``ids_digest``); the
coordinator or an auditor recomputes it. A restarted peer resumes at its checkpoint's round.
Pure integer arithmetic and BLAKE2b: the same on every machine.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

FEISTEL_ROUNDS = 6


@dataclass(frozen=True)
class DataRead:
    """What one round of one data stream read, as its report states it: anyone holding the
    spec and the manifest recomputes ``ids_digest`` from (round, slot, steps)."""

    round: int
    """The round of the data assignment (the round the inner steps trained)."""
    slot: int
    """The data stream."""
    steps: int
    """Inner steps read (each of the assignment's ``batch`` sequences)."""
    ids_digest: str
    """``ids_digest`` of the sequence ids read, in order."""
    epoch: float = 0.0
    """The epoch the round is in (fractional: how far through it)."""


@dataclass(frozen=True)
class DataAssignment:
    """The assignment of one run: ``sequences`` training sequences, ``slots`` streams, rounds
    of ``steps`` inner steps of ``batch`` sequences, keyed by ``seed``."""

    sequences: int
    slots: int
    steps: int
    batch: int
    seed: int
    shards: tuple[int, ...] = ()
    """Sequences in each shard of the split, in the manifest's order (sum: ``sequences``);
    empty: one shard of them all."""

    def __post_init__(self) -> None:
        for name in ("sequences", "slots", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shards and (min(self.shards) < 1 or sum(self.shards) != self.sequences):
            raise ValueError(f"shard sizes must be >= 1 and add up to the {self.sequences} sequences")

    @functools.cached_property
    def _sizes(self) -> tuple[int, ...]:
        return self.shards or (self.sequences,)

    @functools.cached_property
    def _starts(self) -> list[int]:
        """Each shard's first sequence id."""
        return [0, *itertools.accumulate(self._sizes)][:-1]

    @functools.cached_property
    def _stride(self) -> int:
        """``c``: the smallest stride >= H coprime to the page size (a batch's samples a stride apart)."""
        stride = self.steps
        while math.gcd(stride, self.page) != 1:
            stride += 1
        return stride

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        """Epoch ``epoch``'s shard order and where each shard starts in it (the last two epochs
        asked are kept: computing one costs a permutation of the shards)."""
        cache: dict[int, tuple[list[int], list[int]]] = self.__dict__.setdefault("_orders", {})
        found = cache.get(epoch)  # (the trainer and the prefetcher ask from two threads)
        if found is None:
            count = len(self._sizes)
            order = [permute(j, count, key=(self.seed, epoch, -1)) for j in range(count)]
            found = (order, [0, *itertools.accumulate(self._sizes[t] for t in order)][:-1])
            cache[epoch] = found
            for old in sorted(list(cache))[:-2]:
                cache.pop(old, None)
        return found

    @property
    def page(self) -> int:
        """Sequences one stream trains in one round."""
        return self.steps * self.batch

    def round_fits_epoch(self) -> bool:
        """Whether a round's pages (every stream's) fit in the data once: else some sequence
        would be trained twice in one round."""
        return self.slots * self.page <= self.sequences

    @property
    def rounds_per_epoch(self) -> int:
        """Whole rounds in an epoch (``R``; 0 when a round does not fit the data)."""
        return self.sequences // (self.slots * self.page)

    def position(self, round_: int, slot: int, step: int, index: int) -> tuple[int, int]:
        """(epoch, position in that epoch's order) of sample ``index`` of ``step`` (module doc)."""
        if round_ < 0 or not 0 <= slot < self.slots or not 0 <= step < self.steps or not 0 <= index < self.batch:
            raise ValueError(f"no sample ({round_}, {slot}, {step}, {index}) in this assignment")
        if not self.round_fits_epoch():
            raise ValueError(
                f"a round reads {self.slots * self.page} sequences, more than the {self.sequences} there are"
            )
        epoch, in_epoch = divmod(round_, self.rounds_per_epoch)
        return epoch, ((in_epoch * self.slots + slot) * self.steps + step) * self.batch + index

    def batch_ids(self, round_: int, slot: int, step: int) -> list[int]:
        """The sequence ids of stream ``slot``'s batch at ``step`` of round ``round_``."""
        ids = []
        for i in range(self.batch):
            epoch, position = self.position(round_, slot, step, i)
            page, offset = divmod(position, self.page)
            ids.append(self.sequence(epoch, page * self.page + offset * self._stride % self.page))
        return ids

    def sequence(self, epoch: int, position: int) -> int:
        """The sequence at ``position`` of epoch ``epoch``'s order (module doc)."""
        order, begins = self._order(epoch)
        j = bisect.bisect_right(begins, position) - 1
        shard = order[j]
        row = permute(position - begins[j], self._sizes[shard], key=(self.seed, epoch, shard))
        return self._starts[shard] + row

    def page_shards(self, round_: int, slot: int) -> list[int]:
        """The shards (manifest order) that stream ``slot``'s page of round ``round_`` reads."""
        epoch, first = self.position(round_, slot, 0, 0)
        order, begins = self._order(epoch)
        low = bisect.bisect_right(begins, first) - 1
        high = bisect.bisect_right(begins, first + self.page - 1) - 1
        return [order[j] for j in range(low, high + 1)]

    def epoch(self, round_: int) -> float:
        """The data order's position at the start of round ``round_``, in epochs."""
        return round_ / self.rounds_per_epoch if self.rounds_per_epoch else 0.0


def ids_digest(ids: Iterable[int]) -> str:
    """A short digest of a list of sequence ids, in order (what a peer reports it trained)."""
    h = hashlib.blake2b(digest_size=16)
    for i in ids:
        h.update(i.to_bytes(8, "little"))
    return h.hexdigest()


def permute(value: int, size: int, *, key: tuple[int, ...]) -> int:
    """A keyed pseudo-random permutation of ``[0, size)``: a balanced Feistel network over
    ``[0, 4^k)`` (the smallest power of four >= size), repeated on values that fall outside
    ``[0, size)`` (cycle walking; expected < 4 passes)."""
    if not 0 <= value < size:
        raise ValueError(f"{value} is not in [0, {size})")
    half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
    prefix = ("swarmtrain/data/" + "".join(f"{part}/" for part in key)).encode()
    x = value
    while True:
        x = _feistel(x, half_bits, prefix)
        if x < size:
            return x


def _feistel(x: int, half_bits: int, prefix: bytes) -> int:
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for r in range(FEISTEL_ROUNDS):
        digest = hashlib.blake2b(prefix + bytes([r]) + right.to_bytes(8, "little"), digest_size=8).digest()
        left, right = right, left ^ (int.from_bytes(digest, "little") & mask)
    return (left << half_bits) | right
