"""A sparse codec whose kept positions every member knows without being told: a round's mask.

``sparse`` keeps one value in ``1/density`` of each block of ``block = 64/density`` values and
sends those 64 values with a blockwise codec: ``2bit`` by default (one float32 scale and 64
2-bit codes: 20 bytes a block, 1.95% of fp32 at density 1/4) or ``4bit`` (36 bytes). Which
64 it keeps is a function of the round alone (``at_round``), the same in every block and
every member, so no index travels, a reducer averages its senders' values position by
position as the butterfly all-reduce does with a dense codec, and the average it returns
has the same 64 positions per block.

A value the round does not send is left out of the round, as a range whose reducer failed
is (``Codec.unsent``, ``peer.round.host_passes``): θ_g and the momentum keep their values there,
and each member's model keeps its own progress, so the next time the value is sent its
pseudo-gradient holds every inner step since it was last averaged. Each value is thus
averaged DiLoCo's way every ``1/density`` rounds, and the rounds take turns. Carrying the
unsent values in error feedback instead, from a model reset to θ_g each round, adds up
pseudo-gradients taken from the same point, which overshoots: the in-process swarm of 4
diverged (val loss 5.3 against fp32's 2.2 at density 1/8, 4-bit values, 30 rounds). Error
feedback carries the quantization error of the values that were sent.

The mask: with ``block = B`` (a power of two) and the odd multiplier ``STRIDE``, position
``p`` of a block has rank ``p * STRIDE mod B`` (a permutation of the block); round ``r``
keeps the positions whose rank lies in ``[64 r mod B, 64 r mod B + 64)``. Consecutive rounds
take consecutive windows of ranks, so every position is kept exactly once in every
``1/density`` rounds, and a round's positions are spread over the block (ranks in one window
are ``STRIDE^-1`` apart in position), not a run of 64 neighbours. The final, shorter block
of a vector keeps the positions below its length whose rank is in the window.

Why a shared mask and not each member's own top-k (SparseLoCo): members' top-k sets differ,
so the reducer's average has their union as support (about ``1 - (1 - d)^n`` of the values),
which the return leg cannot send sparsely; an all-gather of members' top-k costs ``n - 1``
payloads per member. A shared mask keeps the all-reduce, its cost flat in ``n``, and the
bit-identity rule (one encoding of each averaged part, decoded by everyone).

Layout of ``encode(x)`` for ``n`` values: the value codec's encoding of the kept values in
order (block by block, ascending positions within a block). Decode checks the length against
the kept count (a function of ``n`` and the round), the codes and scales, and writes zeros
elsewhere: no index is read, so none can be out of range or repeated.
"""

from __future__ import annotations

import functools

import torch

from engine.compression import (
    Codec,
    FourBitCodec,
    TwoBitCodec,
    _BlockAbsmaxCodec,
    _check_input,
    _check_numel,
    _out_numel,
)
from protocol.spec import DEFAULT_DENSITY, SPARSE_DENSITIES

DEFAULT_BITS = 2

KEPT = 64
"""Values kept per block: one ``4bit`` scale block."""
STRIDE = 0x9E3779B1
"""The rank multiplier (odd, so ``p * STRIDE mod B`` permutes a block of a power-of-two ``B``)."""
VALUE_CODECS: dict[int, type[_BlockAbsmaxCodec]] = {4: FourBitCodec, 2: TwoBitCodec}
"""How the kept values are sent, by bits per value: ``2bit`` (levels -1.5, -0.5, 0.5, 1.5 times
absmax/1.5) or ``4bit``; either with one float32 scale per 64 values, a block's. (Ternary
levels, -1, 0, 1 times the absmax, ended 2.8% over fp32's loss where ``2bit`` ended 2.0%, both
at density 1/4 and outer lr 0.7: most values rounded to zero.)"""
DENSITIES = SPARSE_DENSITIES
"""Densities a spec may name: ``block = 64 / density`` values, at most 4096 (the fragment and
part alignment, ``engine.fragments.FRAGMENT_ALIGN``)."""


def check_density(density: float) -> float:
    """``density`` if ``sparse`` supports it, else ``ValueError`` naming those it does."""
    if isinstance(density, bool) or not isinstance(density, int | float) or float(density) not in DENSITIES:
        names = ", ".join(f"1/{round(1 / d)}" for d in DENSITIES)
        raise ValueError(f"sparse codec: density must be one of {names}, got {density!r}")
    return float(density)


@functools.lru_cache(maxsize=256)
def kept_positions(block: int, round_: int) -> torch.Tensor:
    """The ascending positions of a ``block``-value block that round ``round_`` keeps (``KEPT``
    of them), as int64."""
    start = (KEPT * round_) % block
    ranks = (torch.arange(block, dtype=torch.int64) * STRIDE) % block
    kept = ((ranks - start) % block) < KEPT
    return torch.nonzero(kept).view(-1)


@functools.lru_cache(maxsize=256)
def _unsent_table(block: int, round_: int) -> torch.Tensor:
    """A block's positions round ``round_`` does not send, as a bool mask (read-only: shared)."""
    table = torch.ones(block, dtype=torch.bool)
    table[kept_positions(block, round_)] = False
    return table


class SparseCodec(Codec):
    """``sparse`` at ``density`` with ``bits``-bit values; bound to a round by ``at_round``
    before it encodes or decodes."""

    name = "sparse"
    lossy = True
    stochastic = True

    def __init__(
        self,
        density: float = DEFAULT_DENSITY,
        round_: int | None = None,
        bits: int = DEFAULT_BITS,
        *,
        compiled: bool = True,
    ) -> None:
        self.density = check_density(density)
        self.block = round(KEPT / self.density)
        if round_ is not None and (isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0):
            raise ValueError(f"sparse codec: a round is an int >= 0, got {round_!r}")
        if bits not in VALUE_CODECS or isinstance(bits, bool):
            raise ValueError(
                f"sparse codec: values are sent in {' or '.join(map(str, VALUE_CODECS))} bits, not {bits!r}"
            )
        self.round, self.bits = round_, bits
        self.compiled = compiled
        values = VALUE_CODECS[bits]()
        self._values = values if compiled else values.reference()

    def at_round(self, round_: int) -> SparseCodec:
        return SparseCodec(self.density, round_, self.bits, compiled=self.compiled)

    def reference(self) -> SparseCodec:
        return SparseCodec(self.density, self.round, self.bits, compiled=False)

    def bytes_per_value(self) -> float:
        return self._values.bytes_per_value() * self.density

    def _positions(self) -> torch.Tensor:
        return kept_positions(self.block, self._round())

    def positions(self) -> torch.Tensor:
        """The ascending positions of each block this round sends (int64, ``KEPT`` of them)."""
        return self._positions()

    def sent_residual(self) -> tuple[int, float, float, float, float] | None:
        """``engine.kernels.land_sparse``'s residual arguments: each block's sent values as one
        block of the value codec (``Codec.landing_residual``), or None without the kernels."""
        return self._values.landing_residual()

    def kept(self, numel: int) -> torch.Tensor:
        """The positions of a vector of ``numel`` values this round keeps, ascending (for
        tests and tools: the codec itself never builds this list)."""
        _check_numel(numel, self.name)
        positions = self._positions()
        full, tail = divmod(numel, self.block)
        starts = torch.arange(full, dtype=torch.int64).unsqueeze(1) * self.block
        whole = (starts + positions).view(-1)
        return torch.cat((whole, full * self.block + positions[positions < tail]))

    def unsent(self, start: int, count: int) -> torch.Tensor:
        """The values ``[start, start + count)`` of the vector this round does not send: every
        block's mask is the same, so the pattern repeats every ``block`` values from 0."""
        _check_numel(count, self.name)
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"sparse codec: a start is an int >= 0, got {start!r}")
        table = _unsent_table(self.block, self._round())
        shift = start % self.block
        repeats = -(-(shift + count) // self.block)
        return table.repeat(repeats)[shift : shift + count]

    def _round(self) -> int:
        if self.round is None:
            raise ValueError("sparse codec: bind it to a round first (at_round): its mask is the round's")
        return self.round

    def _kept_count(self, numel: int) -> int:
        positions = self._positions()
        full, tail = divmod(numel, self.block)
        return full * KEPT + int((positions < tail).sum())

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The kept values of ``x``, block by block: a column gather over whole blocks (no
        index per value: a 1.2B vector's would be a gigabyte) and the tail's few."""
        positions = self._positions()
        full, tail = divmod(x.numel(), self.block)
        blocks = x[: full * self.block].view(full, self.block)[:, positions].reshape(-1)
        if not tail:
            return blocks
        return torch.cat((blocks, x[full * self.block :][positions[positions < tail]]))

    def _scatter(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        """A vector of ``numel`` zeros with ``values`` (``_gather``'s order) at the kept positions."""
        positions = self._positions()
        full, tail = divmod(numel, self.block)
        out = torch.zeros(numel, dtype=torch.float32)
        out[: full * self.block].view(full, self.block)[:, positions] = values[: full * KEPT].view(full, KEPT)
        if tail:
            out[full * self.block :][positions[positions < tail]] = values[full * KEPT :]
        return out

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel, self.name)
        return self._values.encoded_size(self._kept_count(numel))

    def encode(self, x: torch.Tensor) -> bytes:
        return self._values.encode(self._gather(_check_input(x, self.name)))

    def encode_unbiased(self, x: torch.Tensor, dither: torch.Tensor) -> bytes:
        return self._values.encode_unbiased(self._gather(_check_input(x, self.name)), dither)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raw = self._check_length(data, numel)
        return self._scatter(self._values.decode(raw, self._kept_count(numel)), numel)

    def decode_sent(self, data: bytes, numel: int) -> torch.Tensor:
        """The kept values alone (``_gather``'s order): a reducer averages ``density`` of the
        vector, not the zeros between."""
        raw = self._check_length(data, numel)
        return self._values.decode(raw, self._kept_count(numel))

    def sent_numel(self, numel: int) -> int:
        return self._kept_count(numel)

    def decode_sent_into(self, data: bytes, numel: int, out: torch.Tensor) -> None:
        raw = self._check_length(data, numel)
        if _out_numel(out, self.name) != self._kept_count(numel):
            raise ValueError(f"{self.name} codec: {out.numel()} values to decode {numel} into")
        self._values.decode_into(raw, out)

    def encode_sent_unbiased(self, values: torch.Tensor, numel: int, dither: torch.Tensor) -> bytes:
        values = _check_input(values, self.name)
        if values.numel() != self._kept_count(numel):
            raise ValueError(
                f"sparse codec: {values.numel()} sent values for {numel} values, expected {self._kept_count(numel)}"
            )
        return self._values.encode_unbiased(values, dither)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x, self.name)
        return self._scatter(self._values.roundtrip(self._gather(x)), x.numel())

    def write_error(self, sent: torch.Tensor, target: torch.Tensor, start: int) -> None:
        """``Codec.write_error`` on the kept columns of the window's blocks only (its start is a
        block's): the kept values' error written in place, the unsent left alone, with no
        dense roundtrip, mask or select (the same bits: each kept value's error is the same
        subtraction)."""
        sent = _check_input(sent, self.name)
        if start % self.block:
            raise ValueError(f"sparse codec: a window starts at {start}, not on a block ({self.block})")
        kept = self._gather(sent)
        error = torch.sub(kept, self._values.roundtrip(kept)).to(target.dtype)  # (rounded as a copy_ rounds)
        positions = self._positions()
        full, tail = divmod(sent.numel(), self.block)
        target[: full * self.block].view(full, self.block)[:, positions] = error[: full * KEPT].view(full, KEPT)
        if tail:
            target[full * self.block :][positions[positions < tail]] = error[full * KEPT :]

    def __repr__(self) -> str:
        return f"SparseCodec(density=1/{self.block // KEPT}, round={self.round}, bits={self.bits})"
