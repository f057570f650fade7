"""Codecs for pseudo-gradient vectors on the wire, and error feedback for lossy ones.

Every codec maps a 1-D float32 CPU tensor to bytes and back. In the swarm all-reduce the
*reducer* of a part encodes the averaged values once and every peer decodes the very same
bytes, so replicas agree bit for bit only if ``decode`` is a pure function of the bytes.

Codecs (``engine.codecs.get_codec(name)``):

``none``  raw IEEE float32, little-endian; 4 bytes per value; lossless.
``fp16``  IEEE half, little-endian; 2 bytes per value. Values are clamped to ±65504 (the
          largest finite half) before the cast, so a large value *saturates* instead of
          becoming Inf; finite input never decodes to a non-finite value.
``int8``  blockwise absmax, 64 values per block. Layout: ``ceil(n/64)`` float32 little-endian
          scales (``absmax/127``, 0 for an all-zero block), then ``n`` int8 codes
          ``q = round(x/scale)`` clamped to [-127, 127]. Code -128 is invalid.
``4bit``  blockwise absmax, 64 values per block, symmetric levels -7..7. Layout:
          ``ceil(n/64)`` float32 little-endian scales (``absmax/7``), then ``ceil(n/2)``
          bytes of nibbles holding ``q + 8`` (1..15), low nibble first; when ``n`` is odd the
          final high nibble is the pad code 8 (zero). Code 0 is invalid, as is any other pad.

Quantized values round half to even (``torch.round``). Within a block of absmax ``a`` the
error is at most ``scale/2`` (``a/254`` for int8, ``a/14`` for 4bit), up to float32
rounding of the division; blocks whose absmax is subnormal may decode to zero. A scale whose
largest level would overflow float32 is nudged down by one ulp, so finite input always
decodes to finite values.

Block alignment: blocks are independent, so encoding a vector equals encoding its slices cut
at multiples of ``block`` and concatenating their scales and their codes (``block`` is even,
so 4-bit nibbles never straddle a cut).

Why decode is deterministic: it only reads fixed-width little-endian fields, converts each
integer code exactly to float32 and multiplies it by its block's float32 scale — one
correctly rounded IEEE multiplication per value, no reduction, no fused multiply-add, no
dependence on thread count or summation order. (A process that enabled
``torch.set_flush_denormal(True)`` would flush subnormal products; swarmtrain never does.)
Decode rejects, with ``MalformedTensorError``, bytes of the wrong length, negative/NaN/Inf
scales, out-of-range codes and any payload that would decode to a non-finite value.

``ErrorFeedback`` (EF-SGD) carries what a lossy codec dropped in one round into the next:
``sent = delta + residual``; ``residual = sent - decoded(sent)``.
"""

from __future__ import annotations

import abc
import copy
import functools
import itertools
import logging
import os
import sys
from types import ModuleType

import numpy as np
import torch

from protocol.errors import MalformedTensorError

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0
"""Largest finite IEEE half; fp16 encoding saturates at ±FP16_MAX."""

_SCALE_BYTES = 4
_CHUNK = 1 << 20
"""Values processed at a time; a multiple of every block (and even), so chunking is exact."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite; a cheap sum first (NaN/Inf always propagate into it),
    the element-wise test only when the sum is not finite (which may also be an overflow)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_input(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Return ``x`` as a contiguous, detached 1-D float32 CPU tensor, or raise ``ValueError``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{codec} codec: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"{codec} codec: expected dtype float32, got {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"{codec} codec: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{codec} codec: expected a CPU tensor, got device {x.device}")
    if not all_finite(x):
        raise ValueError(f"{codec} codec: input contains NaN or Inf")
    return x.detach().contiguous()


def _check_numel(numel: int, codec: str) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{codec} codec: numel must be a non-negative int, got {numel!r}")


def _as_bytes(data: bytes, codec: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedTensorError(f"{codec} codec: expected bytes, got {type(data).__name__}")
    return bytes(data) if isinstance(data, memoryview) else data


def _read(data: bytes, dtype: str, offset: int, count: int) -> torch.Tensor:
    """Copy ``count`` values of numpy ``dtype`` at byte ``offset`` into a new native tensor."""
    array = np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))


def _write(t: torch.Tensor, dtype: str) -> bytes:
    """Bytes of ``t`` in numpy ``dtype`` (explicit byte order)."""
    return t.numpy().astype(np.dtype(dtype), copy=False).tobytes()


KERNELS_ENV = "SWARMTRAIN_CODEC_KERNELS"
KERNELS_MIN_VALUES = 1 << 22
"""A peer whose vector is shorter (4M values, 16 MB of float32) runs the torch reference
(``choose_kernels``): numba's start costs a process 2-3 s of CPU here, once, more than the
kernels save on rounds whose passes take milliseconds."""


_chosen: list[bool] = []
"""``choose_kernels``'s choice for this process (and the averager process it forks), if made."""


@functools.cache
def compiled_kernels() -> ModuleType | None:
    """``engine.kernels`` (imported on first use: numba compiles or loads its kernels), or
    None where the codecs run on the torch reference: ``SWARMTRAIN_CODEC_KERNELS=off``, else
    ``choose_kernels``'s choice (``on`` takes them without one; a process that never chose,
    such as a tool that decodes a few tensors, runs the reference and pays no compilation),
    and never on a big-endian machine (the kernels write native byte order)."""
    wanted = os.environ.get(KERNELS_ENV, "auto")
    if wanted == "off" or (wanted != "on" and not (_chosen and _chosen[-1])) or sys.byteorder != "little":
        return None
    try:
        from engine import kernels
    except Exception as exc:  # noqa: BLE001 - numba missing or unable to load here: the reference gives the same bits
        logger.warning("compiled kernels unavailable (%s); codecs and host passes run on the torch reference", exc)
        return None
    return kernels


def choose_kernels(numel: int) -> bool:
    """A peer's choice for its vector of ``numel`` values, made before it starts its averager
    (whose process is forked: it inherits the choice): the compiled kernels for
    ``KERNELS_MIN_VALUES`` or more, else the reference, unless ``SWARMTRAIN_CODEC_KERNELS`` is
    ``on`` or ``off``. Either path gives the same bits: peers that chose differently average
    and land the same states. Compiled kernels are loaded here (``warm_kernels``), so that
    neither the forked averager nor the first round pays for it."""
    _chosen.append(numel >= KERNELS_MIN_VALUES)
    compiled_kernels.cache_clear()
    chosen = compiled_kernels() is not None
    if chosen:
        try:
            warm_kernels()
        except Exception as exc:  # a kernel that does not compile here: the reference gives the bits
            if os.environ.get(KERNELS_ENV) == "on":
                raise
            logger.warning("compiled kernels failed here (%s); codecs and host passes run on the torch reference", exc)
            _chosen[-1] = chosen = False
            compiled_kernels.cache_clear()
    wanted = os.environ.get(KERNELS_ENV, "auto")
    logger.info(
        "codecs and host passes: %s (%d values; %s=%s)",
        "compiled kernels" if chosen else "the torch reference",
        numel,
        KERNELS_ENV,
        wanted,
    )
    return chosen


WARM_VALUES = 300
"""The length ``warm_kernels`` runs each pass on: more than one block and not a whole number
of them, so that full and partial blocks (and the 2-bit codec's pad byte) are reached."""


def warm_kernels() -> None:
    """Run every compiled kernel once, on ``WARM_VALUES`` values, through the same calls a
    round makes (each codec's encode, stochastic encode, decode, roundtrip and fused residual;
    the delta with and without a residual; the outer step; the fused landing): numba loads (or first compiles)
    each signature on its first call, 2-3 s of CPU in all here, which inside a round's
    all-reduce made a member late for its group. Nothing where the process runs the reference."""
    kernels = compiled_kernels()
    if kernels is None:
        return
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(WARM_VALUES, generator=generator) * 2 - 1
    launched, dither = torch.zeros(WARM_VALUES), torch.rand(WARM_VALUES + 64, generator=generator)
    for codec in (Fp16Codec(), Int8Codec(), FourBitCodec(), TwoBitCodec()):
        codec.decode(codec.encode(x), WARM_VALUES)
        codec.decode(codec.encode_unbiased(x, dither), WARM_VALUES)
        codec.roundtrip(x)
        ErrorFeedback(codec, WARM_VALUES).update_from(x, launched, 0)
    sent, residual = torch.empty(WARM_VALUES), torch.zeros(WARM_VALUES, dtype=torch.bfloat16)
    for bits in (residual.view(torch.int16).numpy().view(np.uint16), np.empty(0, np.uint16)):
        kernels.delta(x.numpy(), launched.numpy(), bits, sent.numpy())
    kernels.outer_step(x.clone().numpy(), torch.zeros(WARM_VALUES).numpy(), sent.numpy(), 0.7, 0.9, True)
    unsent = (torch.arange(WARM_VALUES) % 3 == 0).numpy()
    kernels.outer_step_masked(x.clone().numpy(), torch.zeros(WARM_VALUES).numpy(), sent.numpy(), unsent, 0.7, 0.9, True)
    bits = residual.view(torch.int16).numpy().view(np.uint16)
    for kind, shift in itertools.product((kernels.LAND_PLAIN, kernels.LAND_FP16, kernels.LAND_ABSMAX), (False, True)):
        model, state = launched.clone().numpy(), x.clone().numpy()
        args = (kind, 127.0, 0.0, -127.0, 127.0, 0.7, 0.9, True, shift)
        kernels.land(state, torch.zeros(WARM_VALUES).numpy(), sent.numpy(), model, bits, *args)
    positions = np.arange(0, 256, 4, dtype=np.int64)
    for (kind, values), shift in itertools.product(
        ((kernels.LAND_PLAIN, np.empty(0, np.uint16)), (kernels.LAND_ABSMAX, bits)), (False, True)
    ):
        model, state = launched.clone().numpy(), x.clone().numpy()
        sparse_args = (positions, 256, kind, 1.5, 0.5, -2.0, 1.0, 0.7, 0.9, True, shift)
        kernels.land_sparse(state, torch.zeros(WARM_VALUES).numpy(), sent.numpy(), model, values, *sparse_args)


def _run(kernels: ModuleType, n: int, fn: object) -> list[object]:
    return list(kernels.run_chunks(n, kernels.CHUNK_VALUES, fn))


def _out_numel(out: torch.Tensor, codec: str) -> int:
    """The values ``decode_into`` writes into ``out``; ``ValueError`` unless ``out`` is a
    contiguous 1-D float32 CPU tensor."""
    if out.dtype != torch.float32 or out.dim() != 1 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"{codec} codec: decodes into a contiguous 1-D float32 CPU tensor, not {out.dtype} {tuple(out.shape)}"
        )
    return out.numel()


def _require_finite(t: torch.Tensor, codec: str) -> torch.Tensor:
    if not all_finite(t):
        raise MalformedTensorError(f"{codec} codec: payload decodes to NaN or Inf")
    return t


class Codec(abc.ABC):
    """A wire format for 1-D float32 vectors.

    ``block``: values per block; encoding a vector equals concatenating the encodings of its
    slices cut at multiples of ``block``. ``lossy``: whether decode(encode(x)) may differ
    from x.
    """

    name: str
    block: int
    lossy: bool
    stochastic: bool = False
    """Whether ``encode_unbiased`` reads its dither; where not it is ``encode``, and a reducer
    draws no dither for it."""
    compiled: bool = True
    """Whether encode, decode and roundtrip run the compiled kernels (``engine.kernels``)
    where they are available; False: the torch reference, which they equal bit for bit."""

    def reference(self) -> Codec:
        """This codec on the torch reference path (the definition the kernels are tested against)."""
        twin = copy.copy(self)
        twin.compiled = False
        return twin

    def kernels(self) -> ModuleType | None:
        """``engine.kernels`` where this codec runs compiled, else None (the reference)."""
        return self._kernels()

    def residual_kernel(
        self, kernels: ModuleType, theta: np.ndarray, launched: np.ndarray, residual: np.ndarray
    ) -> int | None:
        """The fused error feedback (``ErrorFeedback.update_from``): ``residual`` (bfloat16
        bits) ← ``sent − roundtrip(sent)``, ``sent = (θ − launched) + residual``, in one pass;
        the kernel's status, or None where this codec has no such kernel (the caller takes the
        reference's passes)."""
        return None

    def landing_residual(self) -> tuple[int, float, float, float, float] | None:
        """How ``engine.kernels.land`` computes this codec's residual inside the landing's one
        pass: ``(kind, levels, offset, lo, hi)``, or None where it cannot (no kernels, or a
        codec that leaves values unsent: the landing takes its separate passes)."""
        return None

    def _kernels(self) -> ModuleType | None:
        kernels = compiled_kernels() if self.compiled else None
        if kernels is None or (self.block > 1 and self.block != kernels.BLOCK):
            return None
        return kernels

    @abc.abstractmethod
    def bytes_per_value(self) -> float:
        """Nominal wire bytes per value, excluding per-block scales."""

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact length of ``encode`` output for ``numel`` values (scales and padding included)."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Encode a finite 1-D float32 CPU tensor; ``ValueError`` for any other input."""

    @abc.abstractmethod
    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Decode into a new 1-D float32 tensor; ``MalformedTensorError`` for bad bytes."""

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        """``decode(data, out.numel())`` written into ``out`` (a contiguous 1-D float32 CPU
        tensor: where the values go, e.g. their range of the vector an all-reduce averages),
        without a fresh tensor and a copy where the codec can. ``MalformedTensorError`` for bad
        bytes, and ``out`` then holds garbage: the caller drops what it was to hold."""
        out.copy_(self.decode(data, _out_numel(out, self.name)))

    def encode_unbiased(self, x: torch.Tensor, dither: torch.Tensor) -> bytes:
        """An encoding whose decoded value is ``x`` *in expectation* over ``dither`` (uniform
        in [0, 1), at least ``x``'s length rounded up to whole blocks), for values that are
        encoded once and never corrected later (the reducer's average). The same wire format
        as ``encode``; a codec without a systematic rounding loss returns ``encode(x)``."""
        return self.encode(x)

    def decode_sent(self, data: bytes, numel: int) -> torch.Tensor:
        """The values of a ``numel``-value vector's encoding that carry anything: what a
        reducer averages. ``decode`` for a codec that sends every value; a codec that leaves
        some out (``unsent``) returns only the sent ones, in its own order, so a reducer's mean
        costs what the wire carries, not the dense vector's length."""
        return self.decode(data, numel)

    def sent_numel(self, numel: int) -> int:
        """How many values ``decode_sent`` of a ``numel``-value vector's encoding returns."""
        return numel

    def decode_sent_into(self, data: bytes, numel: int, out: torch.Tensor) -> None:
        """``decode_sent(data, numel)`` written into ``out`` (``sent_numel(numel)`` values, as
        ``decode_into`` takes them): a reducer's decoded parts in buffers it reuses
        (``engine.part_buffers``). ``ValueError`` for an ``out`` of another length."""
        if _out_numel(out, self.name) != self.sent_numel(numel):
            raise ValueError(f"{self.name} codec: {out.numel()} values to decode {numel} into")
        self.decode_into(data, out)

    def encode_sent_unbiased(self, values: torch.Tensor, numel: int, dither: torch.Tensor) -> bytes:
        """``encode_unbiased`` of the ``numel``-value vector whose sent values are ``values``
        (``decode_sent``'s layout): the same bytes as encoding that vector with zeros at the
        unsent positions."""
        return self.encode_unbiased(values, dither)

    def at_round(self, round_: int) -> Codec:
        """This codec as round ``round_`` of a run uses it: a codec whose wire format depends on
        the round (``engine.sparse_codec``: the round's mask) returns a copy bound to it; the
        others return themselves."""
        return self

    def unsent(self, start: int, count: int) -> torch.Tensor | None:
        """Which of the vector's values ``[start, start + count)`` this codec does not send at
        all (a bool mask), or None when it sends every value. A round leaves those values as
        if their range had not been averaged (``peer.round.host_passes``: θ_g, the momentum and the
        residual keep their values there, the model its own progress)."""
        return None

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` (bit for bit) without building the bytes: what a receiver of
        ``x`` gets, for error feedback. ``x``: a finite 1-D float32 CPU tensor."""
        return self.decode(self.encode(x), x.numel())

    def write_error(self, sent: torch.Tensor, target: torch.Tensor, start: int) -> None:
        """``target`` ← ``sent − roundtrip(sent)`` (rounded to ``target``'s dtype) at the values
        ``[start, start + len(sent))`` this codec sends; ``target`` keeps the others' values
        (``unsent``). ``start``: a multiple of ``block``."""
        unsent = self.unsent(start, sent.numel())
        if unsent is None:
            torch.sub(sent, self.roundtrip(sent), out=target)
        else:
            target.copy_(torch.where(unsent, target, torch.sub(sent, self.roundtrip(sent))))

    def _check_length(self, data: bytes, numel: int) -> bytes:
        _check_numel(numel, self.name)
        raw = _as_bytes(data, self.name)
        expected = self.encoded_size(numel)
        if len(raw) != expected:
            raise MalformedTensorError(f"{self.name} codec: {len(raw)} bytes for {numel} values, expected {expected}")
        return raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCodec(Codec):
    """Raw float32, little-endian; lossless."""

    name = "none"
    block = 1
    lossy = False

    def bytes_per_value(self) -> float:
        return 4.0

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel, self.name)
        return 4 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        return _write(_check_input(x, self.name), "<f4")

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raw = self._check_length(data, numel)
        return _require_finite(_read(raw, "<f4", 0, numel), self.name)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class Fp16Codec(Codec):
    """IEEE half, little-endian; saturates at ±65504 instead of overflowing to Inf."""

    name = "fp16"
    block = 1
    lossy = True

    def bytes_per_value(self) -> float:
        return 2.0

    def residual_kernel(
        self, kernels: ModuleType, theta: np.ndarray, launched: np.ndarray, residual: np.ndarray
    ) -> int:
        return int(kernels.fp16_residual(theta, launched, residual))

    def landing_residual(self) -> tuple[int, float, float, float, float] | None:
        kernels = self._kernels()
        return None if kernels is None else (kernels.LAND_FP16, 0.0, 0.0, 0.0, 0.0)

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel, self.name)
        return 2 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x, self.name)
        kernels = self._kernels()
        if kernels is None:
            return b"".join(
                _write(x[i : i + _CHUNK].clamp(-FP16_MAX, FP16_MAX).to(torch.float16), "<f2")
                for i in range(0, x.numel(), _CHUNK)
            )
        # the CPU's conversion instruction, as torch's cast, into a reused buffer: one copy
        # into the message's bytes instead of torch's clamp, cast and byte-order copies
        n, values = x.numel(), x.numpy()
        halves = kernels.scratch(2 * n).view(np.uint16)
        _run(kernels, n, lambda s, e: kernels.fp16_encode(values[s:e], halves[s:e]))
        return halves.tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raw = self._check_length(data, numel)
        kernels = self._kernels()
        if kernels is None:
            half = _require_finite(_read(raw, "<f2", 0, numel), self.name)
            return half.to(torch.float32)
        out = torch.empty(numel, dtype=torch.float32)
        self._decode_compiled(kernels, raw, out)
        return out

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        kernels = self._kernels()
        if kernels is None:
            super().decode_into(data, out)
            return
        self._decode_compiled(kernels, self._check_length(data, _out_numel(out, self.name)), out)

    def _decode_compiled(self, kernels: ModuleType, raw: bytes, out: torch.Tensor) -> None:
        numel = out.numel()
        halves, values = np.frombuffer(raw, np.uint16, count=numel), out.numpy()
        if any(_run(kernels, numel, lambda s, e: kernels.fp16_decode(halves[s:e], values[s:e]))):
            raise MalformedTensorError(f"{self.name} codec: payload decodes to NaN or Inf")  # as the reference

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        # the same saturating cast as ``encode``; half → float32 is exact, as in ``decode``
        kernels = self._kernels()
        if kernels is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            out = torch.empty_like(x)
            values, result = x.detach().view(-1).numpy(), out.view(-1).numpy()
            _run(kernels, values.size, lambda s, e: kernels.fp16_roundtrip(values[s:e], result[s:e]))
            return out
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


class _BlockAbsmaxCodec(Codec):
    """Blockwise absmax quantization to symmetric integer levels ``-levels..levels``.

    Subclasses define how the integer codes are packed after the float32 scales.
    """

    block = 64
    lossy = True
    stochastic = True
    levels: int

    def _n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    @abc.abstractmethod
    def _codes_size(self, numel: int) -> int:
        """Bytes of packed codes for ``numel`` values."""

    @abc.abstractmethod
    def _pack(self, q: torch.Tensor) -> bytes:
        """Pack integer-valued float32 codes in ``[-levels, levels]``."""

    @abc.abstractmethod
    def _unpack(self, raw: bytes, offset: int, numel: int) -> torch.Tensor:
        """Unpack and range-check codes; return them as an exact float32 tensor."""

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel, self.name)
        return _SCALE_BYTES * self._n_blocks(numel) + self._codes_size(numel)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` zero-padded to whole blocks, shape ``(n_blocks, block)``."""
        pad = self._n_blocks(x.numel()) * self.block - x.numel()
        if pad:
            x = torch.cat((x, x.new_zeros(pad)))
        return x.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor) -> torch.Tensor:
        """``absmax/levels`` per block, nudged down where ``levels*scale`` would overflow."""
        # abs: an all-zero block's scale is +0 (the sign of a zero torch's max returns depends
        # on its vector path; the compiled kernels write +0)
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg()).abs_()
        scales = absmax / self.levels
        for _ in range(4):
            overflow = ~torch.isfinite(scales * self.levels)
            if not bool(overflow.any()):
                return scales
            nudged = torch.nextafter(scales, torch.zeros_like(scales))
            scales = torch.where(overflow, nudged, scales)
        raise AssertionError("scale overflow guard did not converge")

    def _quantize(self, x: torch.Tensor, dither: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, integer-valued float32 codes of the padded blocks) of a slice that starts on
        a block boundary. Codes round to nearest, or with ``dither`` stochastically:
        ``floor(y + u)``, u uniform in [0, 1), whose expectation is y."""
        blocks = self._blocks(x)
        scales = self._scales(blocks)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        y = blocks / divisor
        if dither is None:
            y.round_()
        else:
            y.add_(dither[: y.numel()].view(y.shape)).floor_()
        return scales, y.clamp_(-self.levels, self.levels)

    def _encode_chunk(self, x: torch.Tensor, dither: torch.Tensor | None = None) -> tuple[bytes, bytes]:
        """(scales, packed codes) of a slice that starts on a block boundary."""
        scales, q = self._quantize(x, dither)
        return _write(scales, "<f4"), self._pack(q.view(-1)[: x.numel()])

    def encode_unbiased(self, x: torch.Tensor, dither: torch.Tensor) -> bytes:
        # rounding to nearest zeroes every value below half a step of its block (absmax/254
        # for int8, absmax/14 for 4-bit), round after round; stochastic rounding loses nothing
        # in expectation
        padded = self._n_blocks(x.numel()) * self.block
        if dither.dtype != torch.float32 or dither.numel() < padded:
            raise ValueError(f"{self.name} codec: dither must be float32 with at least {padded} values")
        return self._encode(x, dither)

    _offset = 0.0
    """Added to ``x / scale`` before rounding; the level is the rounded value minus it."""
    _bits: int
    """Bits of one packed code."""
    _bias = 0
    """Added to the integer level to make the packed code (and a pad code's value)."""
    _invalid = -1
    """A packed code no encoder writes (−1: none)."""

    def _kernel_args(self) -> tuple[float, float, float, float]:
        """(levels, offset, lowest, highest rounded value) for ``engine.kernels``."""
        return float(self.levels), self._offset, -float(self.levels), float(self.levels)

    def _per_byte(self) -> int:
        return 8 // self._bits

    def residual_kernel(
        self, kernels: ModuleType, theta: np.ndarray, launched: np.ndarray, residual: np.ndarray
    ) -> int:
        return int(kernels.absmax_residual(theta, launched, residual, *self._kernel_args()))

    def landing_residual(self) -> tuple[int, float, float, float, float] | None:
        kernels = self._kernels()
        return None if kernels is None else (kernels.LAND_ABSMAX, *self._kernel_args())

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        # the codes and scales ``encode`` would write, multiplied as ``decode`` multiplies them
        kernels = self._kernels()
        if kernels is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            flat = x.detach().contiguous().view(-1)
            out = torch.empty_like(flat)
            values, levels = flat.numpy(), self._kernel_args()
            result, block_scales = out.numpy(), np.empty(self._n_blocks(flat.numel()), np.float32)
            block = self.block

            def run(s: int, e: int) -> None:
                kernels.absmax_roundtrip(values[s:e], *levels, block_scales[s // block :], result[s:e])

            _run(kernels, flat.numel(), run)
            return out.view(x.shape)
        out = torch.empty_like(x)
        for i in range(0, x.numel(), _CHUNK):
            piece = x[i : i + _CHUNK]
            scales, q = self._quantize(piece)
            q.add_(0.0)  # -0.0 codes (rounded small negatives) are +0 once written as integers
            self._dequantize(q.view(-1)[: piece.numel()], scales, out[i : i + piece.numel()])
        return out

    def encode(self, x: torch.Tensor) -> bytes:
        return self._encode(x, None)

    def _encode(self, x: torch.Tensor, dither: torch.Tensor | None) -> bytes:
        x = _check_input(x, self.name)
        kernels = self._kernels()
        if kernels is not None:
            return self._encode_compiled(kernels, x, dither)
        parts = [
            self._encode_chunk(x[i : i + _CHUNK], None if dither is None else dither[i:])
            for i in range(0, x.numel(), _CHUNK)
        ]
        return b"".join([p[0] for p in parts] + [p[1] for p in parts])

    def _read_scales(self, raw: bytes, numel: int) -> torch.Tensor:
        scales = _read(raw, "<f4", 0, self._n_blocks(numel))
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise MalformedTensorError(f"{self.name} codec: negative, NaN or Inf block scale")
        return scales

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """``out = q * scale of its block``: one IEEE float32 multiplication per value."""
        whole = q.numel() // self.block * self.block
        rows = whole // self.block
        torch.mul(
            q[:whole].view(rows, self.block),
            scales[:rows].unsqueeze(1),
            out=out[:whole].view(rows, self.block),
        )
        if whole < q.numel():
            torch.mul(q[whole:], scales[rows], out=out[whole:])

    def _encode_compiled(self, kernels: ModuleType, x: torch.Tensor, dither: torch.Tensor | None) -> bytes:
        n, block, per_byte = x.numel(), self.block, self._per_byte()
        blocks = self._n_blocks(n)
        out = kernels.scratch(self.encoded_size(n))
        scales, packed = out[: _SCALE_BYTES * blocks].view(np.float32), out[_SCALE_BYTES * blocks :]
        values, levels = x.numpy(), self._kernel_args()
        noise = dither.numpy() if dither is not None else np.empty(0, np.float32)

        def run(s: int, e: int) -> None:
            kernels.absmax_encode(
                values[s:e], noise[s:e] if noise.size else noise, *levels, self._bits, self._bias,
                scales[s // block :], packed[s // per_byte :],
            )  # fmt: skip

        _run(kernels, n, run)
        return out.tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raw = self._check_length(data, numel)
        scales = self._read_scales(raw, numel)
        codes_at = _SCALE_BYTES * scales.numel()
        out = torch.empty(numel, dtype=torch.float32)
        kernels = self._kernels()
        if kernels is not None:
            self._decode_compiled(kernels, raw, codes_at, scales, out)
            return out
        for i in range(0, numel, _CHUNK):
            count = min(_CHUNK, numel - i)
            q = self._unpack(raw, codes_at + self._codes_size(i), count)
            first = i // self.block
            self._dequantize(q, scales[first : first + self._n_blocks(count)], out[i : i + count])
        return _require_finite(out, self.name)

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        kernels = self._kernels()
        if kernels is None:
            super().decode_into(data, out)
            return
        raw = self._check_length(data, _out_numel(out, self.name))
        scales = self._read_scales(raw, out.numel())
        self._decode_compiled(kernels, raw, _SCALE_BYTES * scales.numel(), scales, out)

    def _decode_compiled(
        self, kernels: ModuleType, raw: bytes, codes_at: int, scales: torch.Tensor, out: torch.Tensor
    ) -> None:
        numel, block, per_byte = out.numel(), self.block, self._per_byte()
        packed = np.frombuffer(raw, np.uint8, offset=codes_at)
        factors, values = scales.numpy(), out.numpy()

        def run(s: int, e: int) -> int:
            # the last piece holds the pad codes, if any: every byte up to the payload's end
            bytes_end = packed.size if e == numel else e // per_byte
            return int(
                kernels.absmax_decode(
                    factors[s // block :], packed[s // per_byte : bytes_end], e - s, self._bits, self._bias,
                    self._offset, self._invalid, values[s:e],
                )
            )  # fmt: skip

        if any(_run(kernels, numel, run)):
            # refused: the reference names what is wrong (and refuses exactly what the kernel does)
            self.reference().decode(raw, numel)
            raise MalformedTensorError(f"{self.name} codec: an out-of-range code, a bad pad or a non-finite value")


class Int8Codec(_BlockAbsmaxCodec):
    """Blockwise absmax int8: scale ``absmax/127``, codes in [-127, 127]."""

    name = "int8"
    levels = 127
    _bits = 8
    _invalid = 0x80  # the byte of -128

    def bytes_per_value(self) -> float:
        return 1.0

    def _codes_size(self, numel: int) -> int:
        return numel

    def _pack(self, q: torch.Tensor) -> bytes:
        return q.to(torch.int8).numpy().tobytes()

    def _unpack(self, raw: bytes, offset: int, numel: int) -> torch.Tensor:
        codes = _read(raw, "i1", offset, numel)
        if bool((codes == -128).any()):
            raise MalformedTensorError(f"{self.name} codec: out-of-range code -128")
        return codes.to(torch.float32)


class FourBitCodec(_BlockAbsmaxCodec):
    """Blockwise absmax 4-bit: scale ``absmax/7``, nibbles ``q + 8`` in 1..15, low first."""

    name = "4bit"
    levels = 7
    _ZERO = 8
    _bits = 4
    _bias = 8
    _invalid = 0

    def bytes_per_value(self) -> float:
        return 0.5

    def _codes_size(self, numel: int) -> int:
        return -(-numel // 2)

    def _pack(self, q: torch.Tensor) -> bytes:
        nibbles = (q + self._ZERO).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat((nibbles, nibbles.new_full((1,), self._ZERO)))
        pairs = nibbles.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()

    def _unpack(self, raw: bytes, offset: int, numel: int) -> torch.Tensor:
        packed = _read(raw, "u1", offset, self._codes_size(numel))
        nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=1).view(-1)
        if numel % 2 and int(nibbles[-1]) != self._ZERO:
            raise MalformedTensorError(f"{self.name} codec: pad nibble is not the zero code 8")
        nibbles = nibbles[:numel]
        if bool((nibbles == 0).any()):
            raise MalformedTensorError(f"{self.name} codec: out-of-range code 0")
        return nibbles.to(torch.float32) - self._ZERO


class TwoBitCodec(_BlockAbsmaxCodec):
    """Blockwise absmax 2-bit with four levels and no zero: ``-1.5, -0.5, 0.5, 1.5`` times the
    scale ``absmax/1.5``, codes ``q + 1.5`` in 0..3, four to a byte, lowest first (a pad code
    is 0 and decodes to nothing). Every code is valid: a payload is refused for its length or
    its scales only. Used for the values the ``sparse`` codec keeps (``engine.sparse_codec``):
    beside error feedback a level that is never zero costs nothing, and its step (2/3 of the
    block's absmax) is a third of ternary's."""

    name = "2bit"
    levels = 1.5  # type: ignore[assignment]
    _OFFSET = 1.5
    _offset = 1.5
    _bits = 2

    def _kernel_args(self) -> tuple[float, float, float, float]:
        return 1.5, 1.5, 0.0, 3.0

    def bytes_per_value(self) -> float:
        return 0.25

    def _codes_size(self, numel: int) -> int:
        return -(-numel // 4)

    def _quantize(self, x: torch.Tensor, dither: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, levels ``code - 1.5`` of the padded blocks): ``y + 1.5`` rounded to the
        nearest code, or with ``dither`` stochastically (``floor(u + d)``, unbiased within the
        block's range)."""
        blocks = self._blocks(x)
        scales = self._scales(blocks)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        u = blocks / divisor + self._OFFSET
        if dither is None:
            u.round_()
        else:
            u.add_(dither[: u.numel()].view(u.shape)).floor_()
        return scales, u.clamp_(0, 3).sub_(self._OFFSET)

    def _pack(self, q: torch.Tensor) -> bytes:
        codes = (q + self._OFFSET).to(torch.uint8)
        pad = -codes.numel() % 4
        if pad:
            codes = torch.cat((codes, codes.new_zeros(pad)))
        quads = codes.view(-1, 4)
        return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).numpy().tobytes()

    def _unpack(self, raw: bytes, offset: int, numel: int) -> torch.Tensor:
        packed = _read(raw, "u1", offset, self._codes_size(numel))
        codes = torch.stack([(packed >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=1).view(-1)
        if bool((codes[numel:] != 0).any()):
            raise MalformedTensorError(f"{self.name} codec: a pad code is not 0")
        return codes[:numel].to(torch.float32) - self._OFFSET


RESIDUAL_DTYPE = torch.bfloat16
"""How ``ErrorFeedback`` stores its residual (see there)."""


class ErrorFeedback:
    """Residual of a lossy codec carried into the next round (EF-SGD).

    Each round sends ``x = delta + residual`` and keeps ``residual = x - decode(encode(x))``,
    so the running sum of what was decoded trails the running sum of ``delta`` by the current
    residual (at most half a quantization step per value; with fp16, whatever saturated beyond
    ±65504 also stays in the residual). For a non-lossy codec no residual is kept and
    ``compensate`` returns ``delta`` itself.

    The residual is stored in bfloat16 (``RESIDUAL_DTYPE``): half a model copy of host memory
    and of every pass that reads or writes it, for a rounding of 2^-9 of the residual itself
    (float32's range, so nothing the codec dropped can overflow or vanish). That rounding is
    the one error the feedback does not carry: per value and round at most 2^-9 of half a
    quantization step, where the codec's own error is the whole half step. The residual is
    this peer's own (never averaged, never digested), so replicas stay bit-identical.
    """

    def __init__(self, codec: Codec, numel: int, *, residual: torch.Tensor | None = None) -> None:
        """``residual``: a bfloat16 tensor of ``numel`` values to keep the residual in (a view
        of another feedback's: ``window``); zeros of its own when not given."""
        _check_numel(numel, codec.name)
        self.codec = codec
        self.numel = numel
        if residual is not None and codec.lossy:
            if residual.dtype != RESIDUAL_DTYPE or tuple(residual.shape) != (numel,):
                raise ValueError(f"error feedback: a residual of {numel} {RESIDUAL_DTYPE} values, got {residual.shape}")
            self._residual = residual
        else:
            self._residual = torch.zeros(numel if codec.lossy else 0, dtype=RESIDUAL_DTYPE)

    def _check(self, t: torch.Tensor, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"error feedback: {what} must be a float32 tensor")
        if tuple(t.shape) != (self.numel,):
            raise ValueError(f"error feedback: {what} has shape {tuple(t.shape)}, expected ({self.numel},)")

    @property
    def residual(self) -> torch.Tensor:
        """A copy of the current residual, shape ``(numel,)`` (zeros for a non-lossy codec)."""
        if not self.codec.lossy:
            return torch.zeros(self.numel, dtype=torch.float32)
        return self._residual.to(torch.float32)

    def load_residual(self, t: torch.Tensor) -> None:
        """Restore a residual saved from ``residual`` or ``state`` (float32 or bfloat16: a
        float32 one is rounded to bfloat16); ``ValueError`` if it does not fit."""
        if isinstance(t, torch.Tensor) and t.dtype == RESIDUAL_DTYPE:
            t = t.to(torch.float32)
        self._check(t, "residual")
        if not bool(torch.isfinite(t).all()):
            raise ValueError("error feedback: residual contains NaN or Inf")
        if not self.codec.lossy:
            if bool(t.any()):
                raise ValueError(f"error feedback: codec {self.codec.name} keeps no residual")
            return
        self._residual = t.detach().to(device="cpu", dtype=RESIDUAL_DTYPE, copy=True).contiguous()
        logger.debug("loaded %s error-feedback residual of %d values", self.codec.name, self.numel)

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta + residual`` as a new tensor; ``delta`` itself for a non-lossy codec."""
        self._check(delta, "delta")
        if not self.codec.lossy:
            return delta
        return delta + self._residual.to(torch.float32)

    def add_into(self, out: torch.Tensor, offset: int) -> None:
        """``out += residual[offset : offset + len(out)]`` (in place; nothing for a non-lossy codec)."""
        if self.codec.lossy:
            out.add_(self._residual[offset : offset + out.numel()])

    def update_slice(self, sent: torch.Tensor, offset: int, codec: Codec | None = None) -> None:
        """Keep ``sent - decode(encode(sent))`` as the residual of the values at ``offset``
        (``sent``: what was sent for them, delta + the previous residual), ``codec`` being this
        feedback's codec as the round used it (``Codec.at_round``; the codec itself when not
        given). Values the codec did not send at all (``Codec.unsent``) keep their residual:
        the round left them out, and the model kept its progress there."""
        if not self.codec.lossy:
            return
        codec = codec or self.codec
        if offset % codec.block:
            raise ValueError(
                f"error feedback: a window starts at {offset}, not on a {codec.name} block ({codec.block})"
            )
        target = self._residual[offset : offset + sent.numel()]
        codec.write_error(sent, target, offset)
        if not all_finite(target):
            raise ValueError("error feedback: residual overflowed float32")

    def residual_bits(self, offset: int, count: int) -> np.ndarray:
        """The residual's values ``[offset, offset + count)`` as their bfloat16 bits (a view;
        empty for a non-lossy codec): what ``engine.kernels.delta`` adds."""
        if not self.codec.lossy:
            return np.empty(0, np.uint16)
        return self._residual[offset : offset + count].view(torch.int16).numpy().view(np.uint16)

    def update_from(self, theta: torch.Tensor, launched: torch.Tensor, offset: int, codec: Codec | None = None) -> bool:
        """``update_slice`` of ``sent = (θ − launched) + residual`` in one compiled pass, without
        ``sent`` (the same bits as computing it and calling ``update_slice``); False, changing
        nothing, where there is no such pass: the codec runs on the reference, has no residual
        kernel, or leaves values unsent there (the caller then takes the reference's passes).
        ``ValueError`` as ``update_slice``."""
        if not self.codec.lossy:
            return True
        codec = codec or self.codec
        kernels = codec.kernels()
        count = theta.numel()
        if kernels is None or codec.unsent(offset, count) is not None:
            return False
        if offset % codec.block:
            raise ValueError(
                f"error feedback: a window starts at {offset}, not on a {codec.name} block ({codec.block})"
            )
        if not all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (theta, launched)
        ):
            return False
        status = codec.residual_kernel(kernels, theta.numpy(), launched.numpy(), self.residual_bits(offset, count))
        if status is None:
            return False
        if status:
            raise ValueError("error feedback: residual overflowed float32")
        return True

    @property
    def state(self) -> torch.Tensor:
        """The residual itself (not a copy, bfloat16): for saving it; do not modify."""
        return self._residual

    def window(self, start: int, end: int) -> ErrorFeedback:
        """This feedback on the values ``[start, end)`` alone, as a vector of its own whose
        residual *is* this one's there (a view: what it keeps, this keeps). ``start`` must be
        on a block of the codec, as the wire's windows are (``engine.fragments``: fragments
        start on every codec's block), so every window of the view is one of the whole's."""
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"error feedback: window [{start}, {end}) outside its {self.numel} values")
        if start % self.codec.block:
            raise ValueError(f"error feedback: a window starts at {start}, not on a block of {self.codec.block}")
        return ErrorFeedback(self.codec, end - start, residual=self._residual[start:end] if self.codec.lossy else None)

    def update(self, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``sent - decoded`` as the residual (nothing for a non-lossy codec)."""
        self._check(sent, "sent")
        self._check(decoded, "decoded")
        if not self.codec.lossy:
            return
        residual = sent.detach() - decoded.detach()
        if not all_finite(residual):
            raise ValueError("error feedback: residual overflowed float32")
        self._residual = residual.to(RESIDUAL_DTYPE)
