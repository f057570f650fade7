"""Element-wise work in one compiled pass per value (numba), bit for bit what the torch
reference computes: the codecs' (``engine.compression``) and the round's host passes'
(``peer.round.host_passes``: the launch's Δ, the codec residual, the outer step).

The reference codecs run several separately rounded torch ops per value (a clamp, a cast, a
division, a rounding, a clamp, a pack; each reading and writing the whole vector), and their
decode copies the payload twice more before it checks it. Here each value is read once and its
code (or its decoded value) written once, by loops numba compiles to vector machine code, with
exactly the reference's IEEE operations in the reference's order:

- fp16: the saturating clamp, then the CPU's own float32 → half conversion (LLVM's ``fptrunc``:
  F16C's instruction on x86, rounded to nearest even as IEEE defines it, so every machine gives
  torch's bits); decode is the exact ``fpext`` back.
- block absmax (int8, 4-bit, the sparse codec's 2-bit), blocks of ``BLOCK`` values:
  ``absmax / levels`` (a float32 division, nudged one ulp down while ``scale · levels``
  overflows), ``y = x / divisor`` (a division, not a multiplication by a reciprocal: the two
  round differently), ``+ offset``, rounded half to even (``(u + 1.5·2²³) − 1.5·2²³``, exact for
  ``|u| < 2²²``; every ``u`` here is within a few units of the levels) or ``floor(u + dither)``,
  clamped, packed. Decode is ``(code − bias − offset) · scale``, one float32 multiplication.

No fused multiply-add and no reassociation (numba's default: ``fastmath`` off), no dependence
on thread count or vector width: every operation is correctly rounded on its own, so every
machine computes the same bits; the reference stays the definition the tests compare against
(``tests/unit/test_codec_kernels.py``, ``tests/unit/test_pass_kernels.py``). The host passes are
the same discipline: the reference's operations, each rounded on its own, in its order.

Kernels release the GIL (``nogil``): ``run_chunks`` cuts a long vector at block boundaries and
runs the pieces on a few threads. Compiled machine code is cached on disk (numba's cache: next
to this file where it is writable, else the user's cache directory), so only the first process
on a machine pays the compile (a few seconds for all of them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = [
    "BAD_CODE",
    "BLOCK",
    "CHUNK_VALUES",
    "LAND_ABSMAX",
    "LAND_FP16",
    "LAND_PLAIN",
    "NON_FINITE",
    "OK",
    "absmax_decode",
    "absmax_encode",
    "absmax_residual",
    "absmax_roundtrip",
    "delta",
    "fp16_decode",
    "fp16_encode",
    "fp16_residual",
    "fp16_roundtrip",
    "land",
    "land_sparse",
    "outer_step",
    "outer_step_masked",
    "run_chunks",
    "scratch",
    "threads",
]

BLOCK = 64
"""Values per block of the absmax codecs (a constant, so that the compiler unrolls a block)."""
OK, BAD_CODE, NON_FINITE = 0, 1, 2
"""What a decode kernel returns: the payload is sound, holds an invalid code, or decodes to a
non-finite value."""

_FP16_MAX = np.float32(65504.0)
_EXPONENT, _BF16_EXPONENT, _HALF_EXPONENT = 0x7F800000, 0x7F80, 0x7C00
"""The exponent bits of a float32, a bfloat16 and a half: all set, the value is not finite."""
_ROUND_MAGIC = np.float32(12582912.0)
"""1.5·2²³: ``(u + M) − M`` is ``u`` rounded half to even for ``|u| < 2²²``."""

_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}
_INLINE: dict[str, Any] = {**_JIT, "inline": "always"}


def _bits_typer(typingctx: Any, x: Any) -> Any:
    """The bits of a float32 as a uint32 (a register move)."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


def _float_typer(typingctx: Any, x: Any) -> Any:
    """The float32 whose bits are the low 32 bits of an integer."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value, width = args[0], getattr(x, "bitwidth", 32)
        if width > 32:
            value = builder.trunc(value, context.get_value_type(types.uint32))
        elif width < 32:
            value = builder.zext(value, context.get_value_type(types.uint32))
        return builder.bitcast(value, context.get_value_type(types.float32))

    return types.float32(x), codegen


def _half_to_float_typer(typingctx: Any, h: Any) -> Any:
    """The float32 of IEEE half bits (a uint16): the CPU's conversion (F16C's, or the
    compiler's routine where there is none), exact for every half."""
    if h != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _float_to_half_typer(typingctx: Any, f: Any) -> Any:
    """The IEEE half bits (a uint16) of a float32 within ±65504, rounded to nearest even: the
    CPU's conversion (IEEE: the same bits on every machine)."""
    if f != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _bf16_typer(typingctx: Any, f: Any) -> Any:
    """The bfloat16 bits (a uint16) of a float32, rounded to nearest even (a NaN: the quiet NaN
    0x7FC0, torch's), computed on 32-bit integers: numba widens integer arithmetic to 64 bits,
    which halves the lanes of the vector code around it (measured: a residual pass 30% slower)."""
    if f != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(nan, ir.Constant(i32, 0x7FC0), rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _from_bf16_typer(typingctx: Any, h: Any) -> Any:
    """The float32 of bfloat16 bits (a uint16): exact, the bits shifted up."""
    if h != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16)), ir.FloatType())

    return types.float32(types.uint16), codegen


def _all_ones_typer(typingctx: Any, x: Any, mask: Any) -> Any:
    """Whether the bits ``mask`` (a constant) of ``x`` are all set, at ``x``'s own width: a
    float32's exponent (not finite), a bfloat16's or a half's. Kept narrow for the reason
    ``_bf16`` gives."""
    if x == types.float32:
        width = 32
    elif x == types.uint16:
        width = 16
    else:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        kind = ir.IntType(width)
        value = builder.bitcast(args[0], kind) if width == 32 else args[0]
        bits = builder.trunc(args[1], kind)
        return builder.icmp_unsigned("==", builder.and_(value, bits), bits)

    return types.boolean(x, mask), codegen


def _masked_magnitude_typer(typingctx: Any, x: Any, keep: Any) -> Any:
    """``|x|``'s bits (a float32's, the sign cleared) and ``keep`` (an int32 mask), as an int32:
    the bits order as the magnitudes do, so their integer max is the absmax of the kept values.
    Kept narrow for the reason ``_bf16`` gives."""
    if x != types.float32 or keep != types.int32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        magnitude = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))
        return builder.and_(magnitude, args[1])

    return types.int32(x, keep), codegen


_bits: Any = intrinsic(_bits_typer)
_masked_magnitude: Any = intrinsic(_masked_magnitude_typer)
_bf16: Any = intrinsic(_bf16_typer)
_from_bf16: Any = intrinsic(_from_bf16_typer)
_all_ones: Any = intrinsic(_all_ones_typer)
_float: Any = intrinsic(_float_typer)
_half_to_float: Any = intrinsic(_half_to_float_typer)
_float_to_half: Any = intrinsic(_float_to_half_typer)


# ----------------------------------------------------------------------------- fp16


@numba.njit(**_INLINE)
def _to_half(f: np.float32) -> np.uint16:
    """IEEE half of ``f`` clamped to ±65504, rounded to nearest even (``f`` finite)."""
    return _float_to_half(min(max(f, -_FP16_MAX), _FP16_MAX))


@numba.njit(**_INLINE)
def _from_half(h: np.uint16) -> np.float32:
    """The float32 of IEEE half bits ``h`` (exact; Inf and NaN stay so)."""
    return _half_to_float(h)


@numba.njit(**_JIT)
def fp16_encode(x: np.ndarray, out: np.ndarray) -> None:
    """``out`` (uint16) ← the halves of ``x`` (float32, finite), saturating at ±65504."""
    for i in range(x.size):
        out[i] = _to_half(x[i])


@numba.njit(**_JIT)
def fp16_decode(halves: np.ndarray, out: np.ndarray) -> int:
    """``out`` (float32) ← the halves ``halves`` (uint16); ``NON_FINITE`` if any is Inf or NaN
    (``out`` then holds garbage there), else ``OK``."""
    bad = False
    for i in range(halves.size):
        h = halves[i]
        bad |= _all_ones(h, _HALF_EXPONENT)
        out[i] = _from_half(h)
    return NON_FINITE if bad else OK


@numba.njit(**_JIT)
def fp16_roundtrip(x: np.ndarray, out: np.ndarray) -> None:
    """``out`` ← ``decode(encode(x))`` for finite ``x``; a NaN stays NaN (the caller refuses it)."""
    for i in range(x.size):
        f = x[i]
        out[i] = _from_half(_to_half(f)) if f == f else f


# ----------------------------------------------------------------------------- block absmax

TILE = 4096
"""Values the block codecs' kernels take at a time (a multiple of ``BLOCK``): each of its loops
runs over a tile the cache holds (16 KB an array), long enough for the compiler's vector code
and its aliasing checks to pay; a loop per block did not vectorize (3-10x slower)."""
_TILE_BLOCKS = TILE // BLOCK
LAND_TILE = 256
"""Values a landing (and a block residual) takes at a time (a multiple of ``BLOCK``): the six
arrays' values of a tile (5.6 KB) stay in the L1 cache from its first loop to its last, where a
tile of 4096 (90 KB) went to L2 between them: a landing of 50M values 0.31 → 0.22 s/GB
(measured; 128: 0.23, 512: 0.26)."""


@numba.njit(**_INLINE)
def _absmax_block(x: np.ndarray, start: int) -> np.float32:
    """``max |x|`` of the whole block at ``start``, taken on the bits: ``|x|``'s bits (the sign
    bit cleared) order as integers as the values do, and an integer max vectorizes, where a
    float max compiles to a chain of compares kept in order (5x slower, measured). A NaN's bits
    lie above every other value's: a block holding one has a NaN absmax, as ``torch.amax``."""
    bits = x.view(np.int32)
    m = np.int32(0)
    for k in range(BLOCK):
        m = max(m, bits[start + k] & np.int32(0x7FFFFFFF))
    return _float(m)


@numba.njit(**_INLINE)
def _absmax(x: np.ndarray, start: int, end: int) -> np.float32:
    """``_absmax_block`` of a shorter, last block ``[start, end)``."""
    bits = x.view(np.int32)
    m = np.int32(0)
    for i in range(start, end):
        m = max(m, bits[i] & np.int32(0x7FFFFFFF))
    return _float(m)


@numba.njit(**_INLINE)
def _divisors(x: np.ndarray, levels: np.float32, scales: np.ndarray, divisors: np.ndarray) -> np.uint32:
    """Each block's scale ``absmax / levels`` (nudged down one ulp at a time while ``scale ·
    levels`` overflows) in ``scales``, and its divisor (the scale, or 1 for a zero block) in
    ``divisors``, for every block of ``x`` at once: the absmaxes first, then the scales in one loop over the blocks (vector code, where
    one block at a time left a scalar division and its checks between two vector loops), and
    only the rare scale whose ``scale · levels`` overflows nudged down one at a time. Returns
    the bits of the largest absmax (a NaN's lie above every number's)."""
    blocks = (x.size + BLOCK - 1) // BLOCK
    full = x.size // BLOCK
    for b in range(full):
        scales[b] = _absmax_block(x, b * BLOCK)
    if blocks > full:
        scales[full] = _absmax(x, full * BLOCK, x.size)
    overflow = False
    top = np.uint32(0)
    for b in range(blocks):
        top = max(top, _bits(scales[b]))
        scale = scales[b] / levels
        overflow |= not np.isfinite(scale * levels)
        scales[b] = scale
        divisors[b] = scale if scale > 0 else np.float32(1.0)
    if overflow:
        for b in range(blocks):
            scale = scales[b]
            for _ in range(4):
                if np.isfinite(scale * levels):
                    break
                scale = _float(_bits(scale) - 1)  # positive and finite: one ulp toward zero
            scales[b] = scale
            divisors[b] = scale if scale > 0 else np.float32(1.0)
    return top


@numba.njit(**_INLINE)
def _scale_of(absmax: np.float32, levels: np.float32) -> tuple[np.float32, np.float32]:
    """One block's scale and divisor from its absmax, as ``_divisors`` makes them."""
    scale = absmax / levels
    for _ in range(4):
        if np.isfinite(scale * levels):
            break
        scale = _float(_bits(scale) - 1)  # positive and finite: one ulp toward zero
    return scale, scale if scale > 0 else np.float32(1.0)


@numba.njit(**_INLINE)
def _rounded(u: np.float32, lo: np.float32, hi: np.float32) -> np.float32:
    return min(max((u + _ROUND_MAGIC) - _ROUND_MAGIC, lo), hi)


@numba.njit(**_INLINE)
def _dithered(u: np.float32, noise: np.float32, lo: np.float32, hi: np.float32) -> np.float32:
    return min(max(np.floor(u + noise), lo), hi)


@numba.njit(**_INLINE)
def _code(
    x: np.ndarray, dither: np.ndarray, i: int, divisor: np.float32, off: np.float32, lo: np.float32, hi: np.float32,
    bias: int,
) -> int:  # fmt: skip
    u = x[i] / divisor + off
    level = _dithered(u, dither[i], lo, hi) if dither.size else _rounded(u, lo, hi)
    return int(level) + bias


@numba.njit(**_JIT)
def absmax_encode(
    x: np.ndarray, dither: np.ndarray, levels: float, offset: float, lo: float, hi: float, bits: int, bias: int,
    scales: np.ndarray, packed: np.ndarray,
) -> None:  # fmt: skip
    """Blockwise absmax codes of ``x`` (whose first value starts a block): ``scales`` (float32,
    one per block) and ``packed`` (uint8: one code per byte for ``bits`` 8, two for 4, four for
    2, lowest first; each ``int(level) + bias`` masked to ``bits``; a final partial byte padded
    with ``bias``). ``dither``: empty (round to nearest), or at least ``len(x)`` uniform values
    (stochastic rounding)."""
    lv, off, low, high = np.float32(levels), np.float32(offset), np.float32(lo), np.float32(hi)
    n = x.size
    mask = (1 << bits) - 1
    per_byte = 8 // bits
    stochastic = dither.size > 0
    divisors = np.empty(_TILE_BLOCKS, np.float32)
    for b in range((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        end = min(s + BLOCK, n)
        if b % _TILE_BLOCKS == 0:
            _divisors(x[s : s + TILE], lv, scales[b : b + _TILE_BLOCKS], divisors)
        d = divisors[b % _TILE_BLOCKS]
        first = s // per_byte
        # views of the block: loops from 0 vectorize (see ``TILE``)
        xb = x[s:end]
        db = dither[s:end] if stochastic else dither
        pb = packed[first : first + BLOCK // per_byte]
        if end - s == BLOCK and bits == 8:
            if stochastic:
                for k in range(BLOCK):
                    pb[k] = np.uint8((np.int32(_dithered(xb[k] / d + off, db[k], low, high)) + bias) & mask)
            else:
                for k in range(BLOCK):
                    pb[k] = np.uint8((np.int32(_rounded(xb[k] / d + off, low, high)) + bias) & mask)
        elif end - s == BLOCK and bits == 4:
            if stochastic:
                for k in range(BLOCK // 2):
                    c0 = np.int32(_dithered(xb[2 * k] / d + off, db[2 * k], low, high)) + bias
                    c1 = np.int32(_dithered(xb[2 * k + 1] / d + off, db[2 * k + 1], low, high)) + bias
                    pb[k] = np.uint8(c0 | (c1 << 4))
            else:
                for k in range(BLOCK // 2):
                    c0 = np.int32(_rounded(xb[2 * k] / d + off, low, high)) + bias
                    c1 = np.int32(_rounded(xb[2 * k + 1] / d + off, low, high)) + bias
                    pb[k] = np.uint8(c0 | (c1 << 4))
        elif end - s == BLOCK and bits == 2:
            if stochastic:
                for k in range(BLOCK // 4):
                    i = 4 * k
                    c0 = np.int32(_dithered(xb[i] / d + off, db[i], low, high)) + bias
                    c1 = np.int32(_dithered(xb[i + 1] / d + off, db[i + 1], low, high)) + bias
                    c2 = np.int32(_dithered(xb[i + 2] / d + off, db[i + 2], low, high)) + bias
                    c3 = np.int32(_dithered(xb[i + 3] / d + off, db[i + 3], low, high)) + bias
                    pb[k] = np.uint8(c0 | (c1 << 2) | (c2 << 4) | (c3 << 6))
            else:
                for k in range(BLOCK // 4):
                    i = 4 * k
                    c0 = np.int32(_rounded(xb[i] / d + off, low, high)) + bias
                    c1 = np.int32(_rounded(xb[i + 1] / d + off, low, high)) + bias
                    c2 = np.int32(_rounded(xb[i + 2] / d + off, low, high)) + bias
                    c3 = np.int32(_rounded(xb[i + 3] / d + off, low, high)) + bias
                    pb[k] = np.uint8(c0 | (c1 << 2) | (c2 << 4) | (c3 << 6))
        else:  # the last, partial block: value by value, pads are ``bias``
            for j in range(first, (end + per_byte - 1) // per_byte):
                byte = 0
                for k in range(per_byte):
                    i = j * per_byte + k
                    code = bias
                    if i < end:
                        code = _code(x, dither, i, d, off, low, high, bias) & mask
                    byte |= code << (k * bits)
                packed[j] = np.uint8(byte)


@numba.njit(**_JIT)
def absmax_roundtrip(
    x: np.ndarray, levels: float, offset: float, lo: float, hi: float, scales: np.ndarray, out: np.ndarray
) -> None:
    """``out`` ← ``decode(encode(x))`` (rounding to nearest) without the bytes: each level
    ``round(x / divisor + offset) − offset``, clamped, times its block's scale (``scales``: a
    block's worth of room per block, written)."""
    lv, off, low, high = np.float32(levels), np.float32(offset), np.float32(lo), np.float32(hi)
    zero = np.float32(0.0)
    n = x.size
    divisors = np.empty(_TILE_BLOCKS, np.float32)
    for b in range((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        end = min(s + BLOCK, n)
        if b % _TILE_BLOCKS == 0:
            _divisors(x[s : s + TILE], lv, scales[b : b + _TILE_BLOCKS], divisors)
        d, scale = divisors[b % _TILE_BLOCKS], scales[b]
        xb, ob = x[s:end], out[s:end]  # views: loops from 0 vectorize (see ``TILE``)
        if end - s == BLOCK:
            for k in range(BLOCK):
                q = _rounded(xb[k] / d + off, low, high) - off
                ob[k] = (q + zero) * scale  # a −0 level is the code 0: +0
        else:
            for k in range(end - s):
                q = _rounded(xb[k] / d + off, low, high) - off
                ob[k] = (q + zero) * scale


@numba.njit(**_JIT)
def absmax_decode(
    scales: np.ndarray, packed: np.ndarray, n: int, bits: int, bias: int, offset: float, invalid: int,
    out: np.ndarray,
) -> int:  # fmt: skip
    """``out`` ← ``(code − bias − offset) · scale`` for the ``n`` codes in ``packed`` (as
    ``absmax_encode`` packs them; for ``bits`` 8 a byte is a two's-complement code); returns
    ``BAD_CODE`` for a code equal to ``invalid`` (−1: none is) or a pad code other than
    ``bias``, else ``NON_FINITE`` for a value that overflows, else ``OK``."""
    off = np.float32(offset)
    mask = (1 << bits) - 1
    per_byte = 8 // bits
    bad = False
    nonfinite = False
    for b in range((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        end = min(s + BLOCK, n)
        scale = scales[b]
        first = s // per_byte
        # views of the block: loops from 0 vectorize (see ``TILE``)
        ob = out[s:end]
        pb = packed[first : first + BLOCK // per_byte]
        if end - s == BLOCK and bits == 8:
            for k in range(BLOCK):
                code = np.int32(pb[k])
                bad |= code == invalid
                value = (np.float32((code ^ 0x80) - 0x80 - bias) - off) * scale
                nonfinite |= _all_ones(value, _EXPONENT)
                ob[k] = value
        elif end - s == BLOCK and bits == 4:
            for k in range(BLOCK // 2):
                byte = np.int32(pb[k])
                c0, c1 = byte & 0xF, (byte >> 4) & 0xF
                bad |= (c0 == invalid) | (c1 == invalid)
                v0 = (np.float32(c0 - bias) - off) * scale
                v1 = (np.float32(c1 - bias) - off) * scale
                nonfinite |= _all_ones(v0, _EXPONENT) | _all_ones(v1, _EXPONENT)
                ob[2 * k], ob[2 * k + 1] = v0, v1
        elif end - s == BLOCK and bits == 2:
            for k in range(BLOCK // 4):
                byte = np.int32(pb[k])
                for h in range(4):
                    code = (byte >> (2 * h)) & 0x3
                    bad |= code == invalid
                    value = (np.float32(code - bias) - off) * scale
                    nonfinite |= _all_ones(value, _EXPONENT)
                    ob[4 * k + h] = value
        else:  # the last, partial block, and its pad codes
            for j in range(first, packed.size):
                byte = np.int32(packed[j])
                for h in range(per_byte):
                    i = j * per_byte + h
                    code = (byte >> (h * bits)) & mask
                    if i >= end:
                        bad |= code != bias
                        continue
                    bad |= code == invalid
                    if bits == 8:
                        code = (code ^ 0x80) - 0x80
                    value = (np.float32(code - bias) - off) * scale
                    nonfinite |= _all_ones(value, _EXPONENT)
                    out[i] = value
    if bad:
        return BAD_CODE
    return NON_FINITE if nonfinite else OK


# ----------------------------------------------------------------------------- threads

CHUNK_VALUES = 1 << 20
"""Values per piece a thread takes (a multiple of ``BLOCK`` and of 4, so that pieces start on a
block and on a byte); shorter vectors run on the calling thread."""

_POOL: ThreadPoolExecutor | None = None
_POOL_WIDTH = 0
_POOL_LOCK = threading.Lock()


def _forget_pool_in_child() -> None:
    """A forked child (the averager, forked again when a peer moves) inherits the pool object but
    not its threads: work queued on it would wait forever. It starts its own."""
    global _POOL, _POOL_WIDTH, _POOL_LOCK
    _POOL, _POOL_WIDTH, _POOL_LOCK = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
T = TypeVar("T")


_LOCAL = threading.local()
SCRATCH_MAX_BYTES = 8 << 20
"""The largest output a thread keeps a buffer for (an all-reduce part is at most 1 MiB on the
wire); a larger one is written to fresh memory."""


def scratch(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` for the calling thread, reused from call to call: where a
    kernel writes an encoding before it is copied into the ``bytes`` a message needs. Fresh
    memory for every part costs a page fault per 4 KiB page (measured here: writing 1 MiB into
    fresh pages took 3x as long as encoding it)."""
    if nbytes > SCRATCH_MAX_BYTES:
        return np.empty(nbytes, np.uint8)
    buffer: np.ndarray | None = getattr(_LOCAL, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _LOCAL.buffer = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buffer[:nbytes]


def threads() -> int:
    """Threads the kernels use for one long vector: ``SWARMTRAIN_CODEC_THREADS``, else torch's
    intra-op count (the peer sets it), at most the machine's cores."""
    wanted = os.environ.get("SWARMTRAIN_CODEC_THREADS")
    if wanted:
        return max(1, int(wanted))
    import torch

    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def run_chunks(n: int, chunk: int, fn: Callable[[int, int], T]) -> list[T]:
    """``fn(start, end)`` over ``[0, n)`` cut every ``chunk`` values, on up to ``threads()``
    threads (``fn`` runs a ``nogil`` kernel); the results in order."""
    global _POOL, _POOL_WIDTH
    starts = range(0, n, chunk)
    workers = threads()
    if workers == 1 or len(starts) <= 1:
        return [fn(s, min(s + chunk, n)) for s in starts]
    with _POOL_LOCK:
        if _POOL is None or _POOL_WIDTH < workers:
            _POOL, _POOL_WIDTH = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="codec"), workers
        pool = _POOL
    return list(pool.map(lambda s: fn(s, min(s + chunk, n)), starts))


# ----------------------------------------------------------------------------- host passes


@numba.njit(**_JIT)
def delta(theta: np.ndarray, launched: np.ndarray, residual: np.ndarray, out: np.ndarray) -> int:
    """``out`` ← ``(θ − launched) + residual`` (``residual``: bfloat16 bits, or empty for none),
    each operation rounded on its own: what is sent; ``NON_FINITE`` if a value of ``out`` is
    not finite (the launch's check, without a pass of its own), else ``OK``."""
    bad = False
    if residual.size:
        for i in range(out.size):
            d = (theta[i] - launched[i]) + _from_bf16(residual[i])
            bad |= _all_ones(d, _EXPONENT)
            out[i] = d
    else:
        for i in range(out.size):
            d = theta[i] - launched[i]
            bad |= _all_ones(d, _EXPONENT)
            out[i] = d
    return NON_FINITE if bad else OK


@numba.njit(**_JIT)
def fp16_residual(theta: np.ndarray, launched: np.ndarray, residual: np.ndarray) -> int:
    """``residual`` (bfloat16 bits) ← ``sent − roundtrip(sent)``, ``sent = (θ − launched) +
    residual``; ``NON_FINITE`` if a new residual is not finite, else ``OK``."""
    nonfinite = False
    for i in range(theta.size):
        sent = (theta[i] - launched[i]) + _from_bf16(residual[i])
        kept = _from_half(_to_half(sent)) if sent == sent else sent
        r = _bf16(sent - kept)
        nonfinite |= _all_ones(r, _BF16_EXPONENT)
        residual[i] = r
    return NON_FINITE if nonfinite else OK


@numba.njit(**_JIT)
def absmax_residual(
    theta: np.ndarray, launched: np.ndarray, residual: np.ndarray, levels: float, offset: float, lo: float,
    hi: float,
) -> int:  # fmt: skip
    """``absmax_roundtrip``'s residual in one pass: ``residual`` (bfloat16 bits) ← ``sent −
    roundtrip(sent)`` with ``sent = (θ − launched) + residual`` (``θ`` starting a block), tile
    by tile (``LAND_TILE`` values: ``sent`` and the blocks' scales kept in buffers the cache
    holds); ``NON_FINITE`` if a new residual is not finite, else ``OK``."""
    n = theta.size
    sent, scales, divisors = _tile_buffers(min(n, LAND_TILE))
    nonfinite = False
    for s in range(0, n, LAND_TILE):
        end = min(s + LAND_TILE, n)
        t, ln, res = theta[s:end], launched[s:end], residual[s:end]
        nonfinite |= _tile_residual(t, ln, res, sent, scales, divisors, levels, offset, lo, hi)
    return NON_FINITE if nonfinite else OK


@numba.njit(**_INLINE)
def _residual_bound(levels: np.float32, offset: np.float32, lo: np.float32, hi: np.float32) -> np.float32:
    """An absmax below which no block's residual can round to a bfloat16 infinity: ``|x −
    (q − offset)·scale| ≤ (1 + reach)·absmax`` with ``reach = max |level − offset| / levels``,
    and 2¹²⁶ leaves bfloat16's largest value (≈ 3.39·10³⁸) a margin of 4 for the roundings. Below
    it a tile's residual loop needs no check per value (which keeps the compiler's reduction out
    of it: 0.04 s/GB, measured); at or above it (a NaN absmax included) every value is checked."""
    reach = max(abs(lo - offset), abs(hi - offset)) / levels
    return np.float32(2.0**126) / (np.float32(1.0) + reach)


@numba.njit(**_INLINE)
def _tile_buffers(values: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``_tile_residual`` keeps of a tile: its ``sent`` values and its blocks' scales and
    divisors (made once per kernel call, not per tile)."""
    return np.empty(values, np.float32), np.empty(_TILE_BLOCKS, np.float32), np.empty(_TILE_BLOCKS, np.float32)


@numba.njit(**_INLINE)
def _tile_residual(
    t: np.ndarray, launched: np.ndarray, res: np.ndarray, sent: np.ndarray, scales: np.ndarray,
    divisors: np.ndarray, levels: float, offset: float, lo: float, hi: float,
) -> int:  # fmt: skip
    """``absmax_residual`` of one tile (at most ``LAND_TILE`` values, starting a block), with
    buffers of a tile; 1 if a new residual is not finite."""
    lv, off, low, high = np.float32(levels), np.float32(offset), np.float32(lo), np.float32(hi)
    zero = np.float32(0.0)
    count = t.size
    nonfinite = False
    # views of the tile and of its blocks: loops from 0 vectorize (see ``TILE``)
    for i in range(count):
        sent[i] = (t[i] - launched[i]) + _from_bf16(res[i])
    top = _divisors(sent[:count], lv, scales, divisors)
    checked = top >= _bits(_residual_bound(lv, off, low, high))
    for b in range((count + BLOCK - 1) // BLOCK):
        first, stop = b * BLOCK, min(b * BLOCK + BLOCK, count)
        x, out, d, scale = sent[first:stop], res[first:stop], divisors[b], scales[b]
        if x.size == BLOCK and not checked:  # a constant trip count, unrolled; no residual can overflow
            for k in range(BLOCK):
                out[k] = _bf16(x[k] - (_rounded(x[k] / d + off, low, high) - off + zero) * scale)
        elif x.size == BLOCK:
            for k in range(BLOCK):
                r = _bf16(x[k] - (_rounded(x[k] / d + off, low, high) - off + zero) * scale)
                nonfinite |= _all_ones(r, _BF16_EXPONENT)
                out[k] = r
        else:
            for k in range(x.size):
                r = _bf16(x[k] - (_rounded(x[k] / d + off, low, high) - off + zero) * scale)
                nonfinite |= _all_ones(r, _BF16_EXPONENT)
                out[k] = r
    return nonfinite


@numba.njit(**_JIT)
def outer_step(
    theta: np.ndarray, momentum: np.ndarray, averaged: np.ndarray, lr: float, mu: float, nesterov: bool
) -> None:
    """The outer step on one slice, in place, each operation rounded on its own in float32
    (``peer.round.state.outer_step_slice``'s order): ``m ← μ·m + Δ̄``; ``θ ← θ − lr·u`` with
    ``u = Δ̄`` (μ = 0), ``m`` (heavy ball) or ``μ·m + Δ̄`` (Nesterov)."""
    rate, mom = np.float32(lr), np.float32(mu)
    if mom > 0 and nesterov:
        for i in range(theta.size):
            a = averaged[i]
            m = momentum[i] * mom + a
            momentum[i] = m
            theta[i] = theta[i] - (m * mom + a) * rate
    elif mom > 0:
        for i in range(theta.size):
            m = momentum[i] * mom + averaged[i]
            momentum[i] = m
            theta[i] = theta[i] - m * rate
    else:
        for i in range(theta.size):
            theta[i] = theta[i] - averaged[i] * rate


LAND_PLAIN, LAND_FP16, LAND_ABSMAX = 0, 1, 2
"""``land``'s residual: none (no error feedback), fp16's, or a block absmax codec's."""


@numba.njit(**_JIT)
def land(
    theta: np.ndarray, momentum: np.ndarray, averaged: np.ndarray, model: np.ndarray, residual: np.ndarray,
    kind: int, levels: float, offset: float, lo: float, hi: float, lr: float, mu: float, nesterov: bool,
    shift: bool,
) -> int:  # fmt: skip
    """A landing in one pass over memory (``theta`` starting a block; a block codec's residual
    tile by tile, the rest of each value's work in one loop with it): the codec
    residual of what was sent (``kind``: ``LAND_PLAIN`` none, ``LAND_FP16`` as
    ``fp16_residual``, ``LAND_ABSMAX`` as ``absmax_residual`` with ``levels``, ``offset``,
    ``lo``, ``hi``), ``sent = (θ − model) + residual`` from θ_g before the step and the model as
    launched; then ``outer_step`` and ``model`` ← the new θ (``shift``: ``model`` is the launch
    point of an overlapped round, ← the new θ − the launch point, the shift that re-bases the
    model). Each value's operations are those of the separate passes, in their order.
    ``NON_FINITE`` if a new residual is not finite (every value is written all the same), else
    ``OK``."""
    rate, mom = np.float32(lr), np.float32(mu)
    heavy = mom > 0
    nest = heavy and nesterov
    n = theta.size
    nonfinite = False
    # a value's fp16 residual needs no other value: one loop (branches that store kept out of
    # the loops, where they cost the vector code; measured)
    if kind == LAND_FP16:
        for i in range(n):
            t = theta[i]
            sent = (t - model[i]) + _from_bf16(residual[i])
            r = _bf16(sent - (_from_half(_to_half(sent)) if sent == sent else sent))
            nonfinite |= _all_ones(r, _BF16_EXPONENT)
            residual[i] = r
            momentum[i], t = _stepped(t, momentum[i], averaged[i], rate, mom, nest, heavy)
            theta[i] = t
            model[i] = t - model[i] if shift else t
        return NON_FINITE if nonfinite else OK
    if kind == LAND_PLAIN:
        for i in range(n):
            momentum[i], t = _stepped(theta[i], momentum[i], averaged[i], rate, mom, nest, heavy)
            theta[i] = t
            model[i] = t - model[i] if shift else t
        return OK
    sent, scales, divisors = _tile_buffers(min(n, LAND_TILE))
    for s in range(0, n, LAND_TILE):
        # views of one tile: loops from 0 let the compiler drop negative-index handling and vectorize
        end = min(s + LAND_TILE, n)
        t, md, m, a = theta[s:end], model[s:end], momentum[s:end], averaged[s:end]
        nonfinite |= _tile_residual(t, md, residual[s:end], sent, scales, divisors, levels, offset, lo, hi)
        for i in range(t.size):
            m[i], step = _stepped(t[i], m[i], a[i], rate, mom, nest, heavy)
            t[i] = step
            md[i] = step - md[i] if shift else step
    return NON_FINITE if nonfinite else OK


@numba.njit(**_INLINE)
def _stepped(
    theta: np.float32, momentum: np.float32, averaged: np.float32, rate: np.float32, mu: np.float32, nesterov: bool,
    heavy: bool,
) -> tuple[np.float32, np.float32]:  # fmt: skip
    """One value's ``outer_step``: the new momentum and θ, each operation rounded on its own in
    ``outer_step``'s order (``nesterov``: μ > 0 and Nesterov; ``heavy``: μ > 0; with μ = 0 the
    momentum comes back unchanged). The branches are selects on flags fixed for the loop, so a
    loop that calls it stays vector code."""
    m = momentum * mu + averaged
    update = (m * mu + averaged) if nesterov else (m if heavy else averaged)
    return (m if heavy else momentum), theta - update * rate


@numba.njit(**_JIT)
def land_sparse(
    theta: np.ndarray, momentum: np.ndarray, averaged: np.ndarray, model: np.ndarray, residual: np.ndarray,
    positions: np.ndarray, block: int, kind: int, levels: float, offset: float, lo: float, hi: float, lr: float,
    mu: float, nesterov: bool, shift: bool,
) -> int:  # fmt: skip
    """``land`` for a codec that sends, of each ``block`` values (``theta`` starting one), those
    at ``positions`` (ascending, at most ``BLOCK``; the sparse codec's round mask) and nothing
    else, touching only those: the residual of what was sent (``kind``: ``LAND_PLAIN`` none,
    ``LAND_ABSMAX`` each block's sent values gathered as one absmax block, the sparse codec's
    wire layout), the outer step and ``model`` ← the new θ there (``shift``: ``model`` is an
    overlapped round's launch point, ← the new θ − the launch point there and 0 elsewhere, the
    shift that re-bases the model). At the other values θ, the momentum, the residual and (not
    ``shift``) the model keep their bits (the reference steps every value and selects the old
    ones back). ``NON_FINITE`` if a new residual is not finite, else ``OK``."""
    lv, off, low, high = np.float32(levels), np.float32(offset), np.float32(lo), np.float32(hi)
    rate, mom = np.float32(lr), np.float32(mu)
    heavy = mom > 0
    nest = heavy and nesterov
    zero = np.float32(0.0)
    bound = _bits(_residual_bound(lv, off, low, high))
    n = theta.size
    # Every value of a block is computed and the unsent ones' old bits selected back: vector code
    # over the block, where gathering the sent ones was scalar code (2.4x slower, measured).
    keep = np.zeros(block, np.int32)  # all bits set where the round sends a value
    for j in range(positions.size):
        keep[positions[j]] = -1
    sent = np.empty(block, np.float32)
    nonfinite = False
    for base in range(0, n, block):
        end = min(base + block, n)
        t, md, res, m, a = theta[base:end], model[base:end], residual[base:end], momentum[base:end], averaged[base:end]
        k = keep[: end - base]
        if kind == LAND_ABSMAX:  # the sent values of the block are one block of the value codec
            top = np.int32(0)
            for i in range(k.size):
                x = (t[i] - md[i]) + _from_bf16(res[i])
                sent[i] = x
                top = max(top, _masked_magnitude(x, k[i]))
            scale, d = _scale_of(_float(top), lv)
            if top < bound:
                for i in range(k.size):
                    r = _bf16(sent[i] - (_rounded(sent[i] / d + off, low, high) - off + zero) * scale)
                    res[i] = r if k[i] else res[i]
            else:
                for i in range(k.size):
                    r = _bf16(sent[i] - (_rounded(sent[i] / d + off, low, high) - off + zero) * scale)
                    nonfinite |= k[i] != 0 and _all_ones(r, _BF16_EXPONENT)
                    res[i] = r if k[i] else res[i]
        if shift:  # the values not sent do not move the model
            for i in range(k.size):
                stepped_m, step = _stepped(t[i], m[i], a[i], rate, mom, nest, heavy)
                sends = k[i] != 0
                m[i] = stepped_m if sends else m[i]
                md[i] = step - md[i] if sends else zero
                t[i] = step if sends else t[i]
        else:
            for i in range(k.size):
                stepped_m, step = _stepped(t[i], m[i], a[i], rate, mom, nest, heavy)
                sends = k[i] != 0
                m[i] = stepped_m if sends else m[i]
                md[i] = step if sends else md[i]
                t[i] = step if sends else t[i]
    return NON_FINITE if nonfinite else OK


@numba.njit(**_JIT)
def outer_step_masked(
    theta: np.ndarray, momentum: np.ndarray, averaged: np.ndarray, unsent: np.ndarray, lr: float, mu: float,
    nesterov: bool,
) -> None:  # fmt: skip
    """``outer_step`` where ``unsent`` (bool) is false; θ_g and the momentum keep their bits
    where it is true (the reference steps every value, then selects the old ones back)."""
    rate, mom = np.float32(lr), np.float32(mu)
    if mom > 0 and nesterov:
        for i in range(theta.size):
            a, m0, t0 = averaged[i], momentum[i], theta[i]
            m = m0 * mom + a
            t = t0 - (m * mom + a) * rate
            momentum[i] = m0 if unsent[i] else m
            theta[i] = t0 if unsent[i] else t
    elif mom > 0:
        for i in range(theta.size):
            m0, t0 = momentum[i], theta[i]
            m = m0 * mom + averaged[i]
            t = t0 - m * rate
            momentum[i] = m0 if unsent[i] else m
            theta[i] = t0 if unsent[i] else t
    else:
        for i in range(theta.size):
            t0 = theta[i]
            t = t0 - averaged[i] * rate
            theta[i] = t0 if unsent[i] else t
