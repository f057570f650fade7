"""The compiled codec kernels (``engine.kernels``) against the torch reference, bit for
bit: encode, the reducer's stochastic encode, decode and the error feedback's roundtrip, on
values chosen to reach every branch (subnormal halves, saturation, zero blocks of either
sign, scales that overflow, partial blocks, odd lengths), on random payloads a peer could
send, and across thread counts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import compression
from engine import kernels as codec_kernels
from engine.codecs import get_codec
from engine.compression import KERNELS_ENV, KERNELS_MIN_VALUES, Codec, TwoBitCodec, choose_kernels, compiled_kernels
from protocol.errors import MalformedTensorError

CODECS: list[Codec] = [
    get_codec("fp16"),
    get_codec("int8"),
    get_codec("4bit"),
    TwoBitCodec(),
    get_codec("sparse").at_round(5),
    get_codec("sparse", bits=4).at_round(2),
]
IDS = [f"{c.name}-{getattr(c, 'bits', '')}" for c in CODECS]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def vectors() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    # more than one thread's piece, a partial block, an odd length
    yield "normal", torch.randn(codec_kernels.CHUNK_VALUES + 4 * 64 + 77, generator=g)
    n = 20_000 * 64 + 77
    yield "tiny", torch.randn(n, generator=g) * 2.0**-20  # fp16 subnormals
    yield "large", torch.randn(n, generator=g) * 1e5  # fp16 saturates
    yield "zeros", torch.zeros(n)
    yield "negative zeros", -torch.zeros(n)
    mixed = torch.randn(n, generator=g)
    mixed[::7] *= 1e-30  # float32 subnormals and below half of the smallest half
    mixed[::11] = 0.0
    mixed[::13] = -0.0
    mixed[64:128] = 3.3e38  # a block whose absmax/levels·levels overflows: its scale is nudged
    mixed[130] = -3.4e38
    yield "mixed", mixed
    for length in (0, 1, 2, 3, 63, 64, 65, 127, 129, 1001):
        yield f"length {length}", torch.randn(length, generator=g)
    # every float32 exponent, with random mantissas and signs
    bits = torch.arange(0, 2**31 - 2**23, 2**14, dtype=torch.int64)
    bits += torch.randint(0, 2**14, bits.shape, generator=g)
    finite = bits.to(torch.int32).view(torch.float32)
    finite = torch.where(torch.rand(finite.shape, generator=g) < 0.5, finite, -finite)
    yield "every exponent", finite[torch.isfinite(finite)]


VECTORS = list(vectors())


pytestmark = pytest.mark.usefixtures("compiled_path")


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_encode_decode_and_roundtrip_are_the_references_bits(codec: Codec) -> None:
    ref = codec.reference()
    assert codec.compiled and not ref.compiled
    dither = torch.rand(max(len(x) for _, x in VECTORS) + 4096, generator=torch.Generator().manual_seed(3))
    for name, x in VECTORS:
        if codec.name == "sparse" and name == "every exponent":
            x = x[: len(x) // 64 * 64]
        encoded = codec.encode(x)
        assert encoded == ref.encode(x), (codec.name, name, "encode")
        assert codec.encode_unbiased(x, dither) == ref.encode_unbiased(x, dither), (codec.name, name, "unbiased")
        assert same_bits(codec.decode(encoded, x.numel()), ref.decode(encoded, x.numel())), (codec.name, name)
        for path in (codec, ref):  # into a range of a longer vector, as the all-reduce writes its parts
            vector = torch.full((x.numel() + 10,), float("nan"))
            path.decode_into(encoded, vector[5 : 5 + x.numel()])
            assert same_bits(vector[5 : 5 + x.numel()], ref.decode(encoded, x.numel())), (path, name, "into")
            assert vector[:5].isnan().all() and vector[5 + x.numel() :].isnan().all(), (path, name, "outside")
        sent = ref.decode_sent(encoded, x.numel())
        for path in (codec, ref):  # a reducer's decoded part, into a buffer it reuses
            out = torch.full((path.sent_numel(x.numel()),), float("nan"))
            path.decode_sent_into(encoded, x.numel(), out)
            assert same_bits(out, sent), (path, name, "sent into")
        assert same_bits(codec.roundtrip(x), ref.roundtrip(x)), (codec.name, name, "roundtrip")


def test_every_half_decodes_to_the_references_float_or_is_refused_by_both() -> None:
    codec = get_codec("fp16")
    every = np.arange(2**16, dtype=np.uint16)
    finite = every[(every & 0x7C00) != 0x7C00].tobytes()
    assert same_bits(codec.decode(finite, len(finite) // 2), codec.reference().decode(finite, len(finite) // 2))
    for bad in (0x7C00, 0xFC00, 0x7E00, 0x7C01):  # ±Inf, NaNs
        payload = np.array([0, bad, 1], dtype=np.uint16).tobytes()
        for path in (codec, codec.reference()):
            with pytest.raises(MalformedTensorError, match="NaN or Inf"):
                path.decode(payload, 3)


@pytest.mark.parametrize("codec", CODECS[1:4], ids=IDS[1:4])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_peers_random_payload_decodes_alike_or_is_refused_by_both(codec: Codec, data: st.DataObject) -> None:
    """What a hostile sender controls is the payload: both paths accept the same payloads,
    decode them to the same bits, and refuse the rest with ``MalformedTensorError``."""
    numel = data.draw(st.integers(0, 300))
    size = codec.encoded_size(numel)
    raw = bytearray(data.draw(st.binary(min_size=size, max_size=size)))
    blocks = -(-numel // codec.block)
    if data.draw(st.booleans()):  # mostly sane scales, so that codes and pads are what is tested
        scales = np.abs(np.frombuffer(bytes(raw[: 4 * blocks]), np.float32).copy())
        scales[~np.isfinite(scales)] = 1.0
        raw[: 4 * blocks] = scales.astype("<f4").tobytes()
    payload = bytes(raw)
    outcomes: list[torch.Tensor | None] = []
    for path in (codec, codec.reference()):
        try:
            outcomes.append(path.decode(payload, numel))
        except MalformedTensorError:
            outcomes.append(None)
        for decode in (path.decode_into, lambda data, out, path=path: path.decode_sent_into(data, numel, out)):
            out = torch.empty(numel)
            try:
                decode(payload, out)
                outcomes.append(out)
            except MalformedTensorError:
                outcomes.append(None)
    reference = outcomes[3]
    assert all((outcome is None) == (reference is None) for outcome in outcomes), outcomes
    if reference is not None:
        assert all(outcome is not None and same_bits(outcome, reference) for outcome in outcomes)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_decoding_into_a_range_checks_the_range_and_the_payload(codec: Codec) -> None:
    x = torch.randn(256, generator=torch.Generator().manual_seed(5))
    encoded = codec.encode(x)
    for path in (codec, codec.reference()):
        with pytest.raises(MalformedTensorError, match="bytes for"):
            path.decode_into(encoded, torch.empty(100))  # a payload of another length than the range
        for wrong in (torch.empty(512)[::2], torch.empty(256, dtype=torch.float64), torch.empty(16, 16)):
            with pytest.raises(ValueError, match="decodes into a contiguous 1-D float32"):
                path.decode_into(encoded, wrong)
            with pytest.raises(ValueError, match="values to decode 256 into"):
                path.decode_sent_into(encoded, 256, torch.empty(path.sent_numel(256) + 1))
            with pytest.raises(MalformedTensorError, match="bytes for"):
                path.decode_sent_into(encoded[:-1], 256, torch.empty(path.sent_numel(256)))


def test_threads_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3 * codec_kernels.CHUNK_VALUES + 1000, generator=torch.Generator().manual_seed(1))
    dither = torch.rand(x.numel() + 64)
    results = {}
    for workers in ("1", "3"):
        monkeypatch.setenv("SWARMTRAIN_CODEC_THREADS", workers)
        assert codec_kernels.threads() == int(workers)
        results[workers] = [(c.encode(x), c.encode_unbiased(x, dither)) for c in CODECS[:4]]
    assert results["1"] == results["3"]


def test_the_reference_path_is_taken_when_the_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "off")
    compiled_kernels.cache_clear()
    assert compiled_kernels() is None
    x = torch.randn(1000)
    assert get_codec("int8").encode(x) == get_codec("int8").reference().encode(x)


def test_a_peer_chooses_the_kernels_for_a_large_vector_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV)
    monkeypatch.setattr(compression, "_chosen", [])
    assert choose_kernels(KERNELS_MIN_VALUES) and compiled_kernels() is not None
    assert not choose_kernels(KERNELS_MIN_VALUES - 1) and compiled_kernels() is None
    assert KERNELS_ENV not in os.environ  # the choice is the process's, not its environment's
    monkeypatch.setenv(KERNELS_ENV, "on")
    assert choose_kernels(1000)  # told
    monkeypatch.setenv(KERNELS_ENV, "off")
    assert not choose_kernels(KERNELS_MIN_VALUES)
    assert os.environ[KERNELS_ENV] == "off"  # the choice changes no environment


def test_the_kernels_half_conversion_is_torchs_for_every_vector() -> None:
    """The kernels' half conversion (the CPU's ``fptrunc``/``fpext``, which the encode, the
    roundtrip and the fused error feedback use) gives torch's cast's bits, on every vector."""
    for name, x in VECTORS:
        values = x.numpy()
        halves = np.empty(values.size, np.uint16)
        codec_kernels.fp16_encode(values, halves)
        expected = x.clamp(-65504.0, 65504.0).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(halves, expected), name
        back = np.empty(values.size, np.float32)
        codec_kernels.fp16_roundtrip(values, back)
        assert same_bits(torch.from_numpy(back), get_codec("fp16").reference().roundtrip(x)), name


def test_a_forked_child_gets_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The averager's process is forked from the peer's, possibly after the peer used the pool
    (a peer that moves starts a new averager): the child must not queue on the parent's threads.
    (One torch thread: torch's own OpenMP team does not survive a fork either, a separate matter.)"""
    monkeypatch.setenv("SWARMTRAIN_CODEC_THREADS", "2")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(3 * codec_kernels.CHUNK_VALUES)
        expected = get_codec("4bit").encode(x)  # the parent's pool now exists
        pid = os.fork()
        if pid == 0:  # the child: encode on threads, report by exit code, skip pytest's teardown
            code = 1
            try:
                code = 0 if get_codec("4bit").encode(x) == expected else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's encode hung on its parent's pool")
    finally:
        torch.set_num_threads(threads_before)


def test_a_process_that_never_chose_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool that decodes a few tensors (or an averager forked before any choice) pays no
    compilation: without ``choose_kernels`` or ``SWARMTRAIN_CODEC_KERNELS=on``, the reference."""
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(compression, "_chosen", [])
    compiled_kernels.cache_clear()
    try:
        assert compiled_kernels() is None
    finally:
        compiled_kernels.cache_clear()


ROUND_AFTER_CHOICE = """
import numba, torch
from engine import compression
from engine.compression import ErrorFeedback, choose_kernels
from tests.unit.test_pass_kernels import round_on

assert choose_kernels(compression.KERNELS_MIN_VALUES)
from engine import kernels

def compiled():
    return {name: len(f.signatures) for name, f in vars(kernels).items()
            if isinstance(f, numba.core.registry.CPUDispatcher) and not name.startswith("_")}

before = compiled()
for name in ("none", "fp16", "int8", "4bit", "sparse"):
    for overlap in (False, True):
        round_on(name, overlap, [(0, 256)])
    codec = compression.TwoBitCodec() if name == "none" else __import__("engine.codecs").codecs.get_codec(name).at_round(3)
    x = torch.randn(5000)
    codec.decode(codec.encode(x), 5000)
    codec.decode(codec.encode_unbiased(x, torch.rand(6000)), 5000)
    codec.roundtrip(x)
after = compiled()
assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
print("warm", sum(after.values()))
"""


def test_a_peers_choice_loads_every_kernel_a_round_calls() -> None:
    """``choose_kernels`` runs before the averager forks; numba's first call of a signature
    costs seconds of CPU, and inside a round's all-reduce it made a member late for its group
    (a fresh clone's CI). After the choice, a whole round (every codec, overlap or not, a
    missing range) and the codecs' own calls compile nothing more."""
    env = {k: v for k, v in os.environ.items() if k != KERNELS_ENV}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", ROUND_AFTER_CHOICE], cwd=root, env={**env, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("warm ")


BOUNDS_CHECKED = """
import numpy as np
from engine import kernels as k

rng = np.random.default_rng(0)
empty = np.empty(0, np.float32)
for n in (1, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 3 * 4096 + 37, 70_001):
    x, y, avg = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    blocks = (n + k.BLOCK - 1) // k.BLOCK
    for levels, bits in ((127.0, 8), (7.0, 4), (1.5, 2)):
        args = (levels, 0.0, -levels, levels)
        scales, packed = np.empty(blocks, np.float32), np.empty((n * bits + 7) // 8, np.uint8)
        for dither in (empty, rng.random(n).astype(np.float32)):
            k.absmax_encode(x, dither, *args, bits, 0, scales, packed)
            k.absmax_decode(scales, packed, n, bits, 0, 0.0, -1, np.empty(n, np.float32))
        k.absmax_roundtrip(x, *args, np.empty(blocks, np.float32), np.empty(n, np.float32))
        k.absmax_residual(x, y, np.zeros(n, np.uint16), *args)
    halves = np.empty(n, np.uint16)
    k.fp16_encode(x, halves)
    k.fp16_decode(halves, np.empty(n, np.float32))
    k.fp16_roundtrip(x, np.empty(n, np.float32))
    k.fp16_residual(x, y, np.zeros(n, np.uint16))
    k.delta(x, y, np.zeros(n, np.uint16), np.empty(n, np.float32))
    k.outer_step_masked(x.copy(), y.copy(), avg, rng.random(n) < 0.5, 0.7, 0.9, True)
    for block in (64, 256, 4096):
        positions = np.sort(rng.choice(block, 64, replace=False)).astype(np.int64)
        for kind, shift in ((k.LAND_PLAIN, False), (k.LAND_ABSMAX, False), (k.LAND_ABSMAX, True)):
            residual = np.zeros(n if kind != k.LAND_PLAIN else 0, np.uint16)
            args = (positions, block, kind, 1.5, 0.5, -2.0, 1.0, 0.7, 0.9, True, shift)
            k.land_sparse(x.copy(), y.copy(), avg, y.copy(), residual, *args)
    for kind in (k.LAND_PLAIN, k.LAND_FP16, k.LAND_ABSMAX):
        for shift in (False, True):
            residual = np.zeros(n if kind != k.LAND_PLAIN else 0, np.uint16)
            k.land(x.copy(), y.copy(), avg, y.copy(), residual, kind, 127.0, 0.0, -127.0, 127.0, 0.7, 0.9, True, shift)
print("within bounds")
"""


def test_every_kernel_stays_within_its_arrays_at_the_edges_of_blocks_and_tiles(tmp_path: Path) -> None:
    """The kernels run without bounds checks: a write past a view's end corrupts the heap
    silently (a tile's last partial block once wrote a whole block past the residual's end;
    the bits compared equal, and the process died later in ``malloc``). Compiled with numba's
    bounds checks, every kernel at sizes around a block and a tile raises on such an index."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", BOUNDS_CHECKED], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "within bounds"
