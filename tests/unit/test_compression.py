from __future__ import annotations

import math
import struct

import pytest
import torch

from engine.codecs import CODEC_NAMES, get_codec
from engine.compression import FP16_MAX, RESIDUAL_DTYPE, Codec, ErrorFeedback
from protocol.errors import MalformedTensorError, VerificationError

LENGTHS = [0, 1, 2, 63, 64, 65, 127, 128, 129, 1000]
BLOCKWISE = {"int8": 127, "4bit": 7}
DENSE = tuple(name for name in CODEC_NAMES if name != "sparse")
"""The codecs whose wire format is the same in every round (``sparse``: tests/unit/test_sparse_codec.py)."""


def _vector(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def _roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(x.numel())
    out = codec.decode(data, x.numel())
    assert out.dtype == torch.float32 and out.shape == x.shape
    return out


def _n_scale_bytes(codec: Codec, n: int) -> int:
    return 4 * -(-n // codec.block) if codec.name in BLOCKWISE else 0


def test_codec_attributes() -> None:
    expected = {"none": (4.0, 1, False), "fp16": (2.0, 1, True), "int8": (1.0, 64, True)}
    expected["4bit"] = (0.5, 64, True)
    assert set(CODEC_NAMES) == set(expected) | {"sparse"}
    for name, (bpv, block, lossy) in expected.items():
        codec = get_codec(name)
        assert (codec.name, codec.bytes_per_value(), codec.block, codec.lossy) == (
            name,
            bpv,
            block,
            lossy,
        )


def test_unknown_codec_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="none, fp16, int8, 4bit, sparse"):
        get_codec("int4")


@pytest.mark.parametrize("n", LENGTHS)
def test_none_roundtrip_is_exact(n: int) -> None:
    x = _vector(n, seed=n)
    out = _roundtrip(get_codec("none"), x)
    assert torch.equal(out, x)


@pytest.mark.parametrize("n", LENGTHS)
def test_fp16_error_bound(n: int) -> None:
    x = _vector(n, seed=n, scale=100.0)
    out = _roundtrip(get_codec("fp16"), x)
    assert torch.equal(out, x.half().float())
    assert bool(((out - x).abs() <= x.abs() * 2.0**-11).all())


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 3e38, -3e38, 1.0], dtype=torch.float32)
    out = _roundtrip(get_codec("fp16"), x)
    assert out.tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, FP16_MAX, -FP16_MAX, 1.0]
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", list(BLOCKWISE))
@pytest.mark.parametrize("n", LENGTHS)
def test_blockwise_error_is_at_most_half_a_step(name: str, n: int) -> None:
    codec = get_codec(name)
    x = _vector(n, seed=n + 7)
    x[::17] *= 50.0  # blocks with very different ranges
    out = _roundtrip(codec, x)
    pad = -n % 64
    xb = torch.cat((x, x.new_zeros(pad))).view(-1, 64)
    err = torch.cat((out - x, x.new_zeros(pad))).view(-1, 64).abs().amax(dim=1)
    bound = xb.abs().amax(dim=1) / (2 * BLOCKWISE[name])
    assert bool((err <= bound * (1 + 1e-5)).all())
    if n:  # the largest value is the top level, exact up to float32 rounding of the scale
        assert torch.allclose(out.abs().max(), x.abs().max(), rtol=1e-6)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("n", [0, 1, 63, 65, 129])
def test_zero_and_empty_vectors(name: str, n: int) -> None:
    codec = get_codec(name)
    out = _roundtrip(codec, torch.zeros(n))
    assert torch.equal(out, torch.zeros(n))
    if name in BLOCKWISE:
        data = codec.encode(torch.zeros(n))
        assert data[: _n_scale_bytes(codec, n)] == b"\0" * _n_scale_bytes(codec, n)


@pytest.mark.parametrize("name", DENSE)
def test_block_aligned_slices_encode_identically(name: str) -> None:
    codec = get_codec(name)
    x = _vector(301, seed=3)
    x[130] = 40.0
    cut = 128
    whole = codec.encode(x)
    head, tail = codec.encode(x[:cut]), codec.encode(x[cut:])
    s, s1, s2 = (_n_scale_bytes(codec, m) for m in (301, cut, 301 - cut))
    assert whole[:s] == head[:s1] + tail[:s2]
    assert whole[s:] == head[s1:] + tail[s2:]
    parts = torch.cat((codec.decode(head, cut), codec.decode(tail, 301 - cut)))
    assert torch.equal(parts, codec.decode(whole, 301))


@pytest.mark.parametrize("name", DENSE)
def test_decode_is_a_pure_function_of_the_bytes(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(_vector(1000, seed=5))
    first, second = codec.decode(data, 1000), codec.decode(bytes(bytearray(data)), 1000)
    assert torch.equal(first, second)
    assert first.data_ptr() != second.data_ptr()
    first[0] = 123.0  # writable, and not a view of the bytes
    assert torch.equal(codec.decode(data, 1000), second)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 129, 1000])
def test_encoded_size_matches(name: str, n: int) -> None:
    codec = get_codec(name)
    assert len(codec.encode(_vector(n))) == codec.encoded_size(n)


def test_wire_ratios_for_a_million_values() -> None:
    n = 1_000_000
    raw = 4 * n
    x = _vector(n, seed=1)
    sizes = {name: len(get_codec(name).encode(x)) for name in DENSE}
    assert sizes["none"] == raw
    assert sizes["fp16"] == raw // 2
    assert sizes["int8"] / raw <= 0.30
    assert sizes["4bit"] / raw <= 0.16
    assert sizes["int8"] == 4 * 15625 + n
    assert sizes["4bit"] == 4 * 15625 + n // 2


@pytest.mark.parametrize("name", DENSE)
def test_wrong_length_is_rejected(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(_vector(100))
    for bad in (data + b"\0", data[:-1], b""):
        with pytest.raises(MalformedTensorError):
            codec.decode(bad, 100)
    with pytest.raises(MalformedTensorError):
        codec.decode(data, 101)


@pytest.mark.parametrize("name", list(BLOCKWISE))
@pytest.mark.parametrize("scale", [float("nan"), -1.0, float("inf"), float("-inf")])
def test_bad_scale_is_rejected(name: str, scale: float) -> None:
    codec = get_codec(name)
    data = bytearray(codec.encode(_vector(100)))
    data[4:8] = struct.pack("<f", scale)  # the second block's scale
    with pytest.raises(MalformedTensorError, match="scale"):
        codec.decode(bytes(data), 100)


@pytest.mark.parametrize("name", list(BLOCKWISE))
def test_overflowing_scale_is_rejected(name: str) -> None:
    codec = get_codec(name)
    x = torch.zeros(64)
    x[0] = 1.0
    data = bytearray(codec.encode(x))
    data[0:4] = struct.pack("<f", 3e38)
    with pytest.raises(MalformedTensorError, match="NaN or Inf"):
        codec.decode(bytes(data), 64)


def test_4bit_code_zero_is_rejected() -> None:
    codec = get_codec("4bit")
    data = bytearray(codec.encode(_vector(100)))
    data[4 * 2 + 10] &= 0xF0  # low nibble of a code byte -> 0
    with pytest.raises(MalformedTensorError, match="code 0"):
        codec.decode(bytes(data), 100)
    data = bytearray(codec.encode(_vector(100)))
    data[4 * 2 + 11] &= 0x0F  # high nibble -> 0
    with pytest.raises(MalformedTensorError, match="code 0"):
        codec.decode(bytes(data), 100)


def test_4bit_odd_length_pad_must_be_the_zero_code() -> None:
    codec = get_codec("4bit")
    data = codec.encode(_vector(65))
    assert data[-1] >> 4 == 8
    bad = data[:-1] + bytes([(data[-1] & 0x0F) | 0x90])
    with pytest.raises(MalformedTensorError, match="pad"):
        codec.decode(bad, 65)


def test_int8_code_minus_128_is_rejected() -> None:
    codec = get_codec("int8")
    data = bytearray(codec.encode(_vector(100)))
    data[-1] = 0x80
    with pytest.raises(MalformedTensorError, match="-128"):
        codec.decode(bytes(data), 100)


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("none", struct.pack("<f", float("nan"))),
        ("none", struct.pack("<f", float("inf"))),
        ("none", struct.pack("<f", float("-inf"))),
        ("fp16", b"\x00\x7e"),  # half NaN
        ("fp16", b"\x00\x7c"),  # half +Inf
        ("fp16", b"\x00\xfc"),  # half -Inf
    ],
)
def test_non_finite_payload_is_rejected(name: str, payload: bytes) -> None:
    codec = get_codec(name)
    data = codec.encode(torch.ones(3))
    bad = data[: len(payload)] + payload + data[2 * len(payload) :]
    with pytest.raises(MalformedTensorError):
        codec.decode(bad, 3)
    assert issubclass(MalformedTensorError, VerificationError)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.ones(2, 2),
        torch.tensor(1.0),
    ],
)
def test_bad_input_to_encode_is_a_value_error(name: str, bad: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        get_codec(name).encode(bad)


@pytest.mark.parametrize("name", list(BLOCKWISE))
def test_huge_finite_input_never_decodes_to_inf(name: str) -> None:
    codec = get_codec(name)
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, 1.0, 3e38], dtype=torch.float32)
    out = _roundtrip(codec, x)
    assert bool(torch.isfinite(out).all())
    assert out[0] > 3.3e38 and out[1] < -3.3e38


def _send_with_feedback(ef: ErrorFeedback, delta: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """One round as the trainer sends it: encode ``compensate(delta)``, keep the residual."""
    x = ef.compensate(delta)
    data = ef.codec.encode(x)
    decoded = ef.codec.decode(data, ef.numel)
    ef.update(x, decoded)
    return data, decoded


def _sum_error(codec_name: str, rounds: int, feedback: bool) -> list[float]:
    """Max |sum(inputs) - sum(decoded)| after each round for a biased constant input."""
    codec = get_codec(codec_name)
    delta = torch.full((64,), 0.3 / 7)
    delta[0] = 1.0  # block max: scale = 1/7, so the others round to 0 without feedback
    ef = ErrorFeedback(codec, 64)
    sent_sum, decoded_sum = torch.zeros(64), torch.zeros(64)
    errors = []
    for _ in range(rounds):
        if feedback:
            _, decoded = _send_with_feedback(ef, delta)
        else:
            decoded = codec.decode(codec.encode(delta), 64)
        sent_sum += delta
        decoded_sum += decoded
        errors.append(float((sent_sum - decoded_sum).abs().max()))
    return errors


def test_error_feedback_keeps_the_running_sum_within_one_step() -> None:
    with_ef = _sum_error("4bit", 50, feedback=True)
    without = _sum_error("4bit", 50, feedback=False)
    step = 1.0 / 7
    assert max(with_ef) <= step + 1e-5
    assert without[-1] > 2.0  # 50 * 0.3 * step of bias
    assert with_ef[-1] < without[-1] / 5


def test_error_feedback_state() -> None:
    codec = get_codec("int8")
    ef = ErrorFeedback(codec, 100)
    assert torch.equal(ef.residual, torch.zeros(100))
    x = _vector(100)
    data, decoded = _send_with_feedback(ef, x)
    assert torch.equal(decoded, codec.decode(data, 100))
    assert torch.equal(ef.residual, (x - decoded).to(RESIDUAL_DTYPE).float())  # kept in bfloat16
    saved = ef.residual
    ef.load_residual(torch.zeros(100))
    assert torch.equal(ef.residual, torch.zeros(100))
    ef.load_residual(saved)
    assert torch.equal(ef.compensate(x), x + saved)
    with pytest.raises(ValueError):
        ef.load_residual(torch.zeros(99))
    with pytest.raises(ValueError):
        ef.compensate(torch.zeros(101))


def test_error_feedback_without_loss_keeps_no_residual() -> None:
    ef = ErrorFeedback(get_codec("none"), 10)
    x = _vector(10)
    assert ef.compensate(x) is x
    data, decoded = _send_with_feedback(ef, x)
    assert torch.equal(decoded, x)
    assert torch.equal(ef.residual, torch.zeros(10))
    with pytest.raises(ValueError):
        ef.load_residual(torch.ones(10))


@pytest.mark.parametrize("name", ["int8", "4bit"])
def test_the_reducers_unbiased_encoding_keeps_values_that_rounding_to_nearest_zeroes(name: str) -> None:
    codec = get_codec(name)
    x = torch.full((64,), 0.003 if name == "int8" else 0.01)  # below half a step of the block
    x[0] = 1.0
    assert torch.equal(codec.decode(codec.encode(x), 64)[1:], torch.zeros(63))  # lost every round
    runs = 2000
    total = torch.zeros(64)
    for seed in range(runs):
        data = codec.encode_unbiased(x, torch.rand(64, generator=torch.Generator().manual_seed(seed)))
        assert len(data) == codec.encoded_size(64)
        total += codec.decode(data, 64)
    mean = total / runs
    assert mean[0] == 1.0  # the block's absmax is exact
    # kept in expectation: the mean over the runs is within a few standard errors of the value
    assert abs(float(mean[1:].mean()) / float(x[1]) - 1) < 0.05
    assert torch.allclose(mean[1:], x[1:], rtol=0.5)
    dither = torch.rand(64)
    assert codec.encode_unbiased(x, dither) == codec.encode_unbiased(x, dither.clone())  # a function of the dither
    with pytest.raises(ValueError, match="dither"):
        codec.encode_unbiased(x, torch.rand(63))


def test_lossless_and_fp16_codecs_encode_averages_as_usual() -> None:
    x = torch.randn(100)
    for name in ("none", "fp16"):
        codec = get_codec(name)
        assert codec.encode_unbiased(x, torch.rand(100)) == codec.encode(x)


def test_parts_are_whole_blocks_and_small_vectors_are_cut_for_every_member() -> None:
    from engine.allreduce import MAX_PART_VALUES, MIN_PART_SIZE_BYTES, PART_SIZE_BYTES, part_size_bytes

    for name in CODEC_NAMES:
        codec = get_codec(name)
        per_value = codec.bytes_per_value()
        largest = min(PART_SIZE_BYTES, MAX_PART_VALUES * per_value)
        for numel in (1, 1000, 1_450_000, 10**8, 10**10):
            for group in (1, 2, 4, 16):
                size = part_size_bytes(numel, codec, group)
                values = size / per_value
                assert values == int(values) and int(values) % codec.block == 0
                assert size <= max(largest, codec.block * per_value)
                floor = min(MIN_PART_SIZE_BYTES, numel * per_value / group)
                assert size >= floor - codec.block * per_value or values == codec.block
        # a huge vector's parts are the largest allowed, give or take the whole-share rounding
        assert largest * 0.99 <= part_size_bytes(10**10, codec, 4) <= largest
        for numel, group in ((1_450_000, 4), (107_520, 4), (430_000, 16), (4096, 4)):
            parts = math.ceil(numel * per_value / part_size_bytes(numel, codec, group))
            assert parts >= min(group, numel // codec.block)  # every member reduces a share


def _shares(numel: int, codec: Codec, reducers: int) -> tuple[tuple[int, ...], list[int]]:
    """Parts and values hivemind's own container hands each reducer, with this part size (meta
    tensors: no memory, the split is all that is computed)."""
    from hivemind.averaging.partition import TensorPartContainer

    from engine.allreduce import CodecCompression, part_size_bytes

    container = TensorPartContainer(
        [torch.empty(numel, device="meta")],
        [1.0 / reducers] * reducers,
        compression=CodecCompression(codec),
        part_size_bytes=part_size_bytes(numel, codec, reducers),
    )
    values = [sum(part.numel() for part, _ in parts) for parts in container._input_parts_by_peer]
    return container.num_parts_by_peer, values


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_reducer_averages_an_equal_share(name: str) -> None:
    """The round waits for the reducer with the most bytes: each reducer's share is a whole
    number of parts, the same for all, and the shares equal within the codec's blocks. Before,
    a part size that did not divide the share handed a 10.4M-value fragment's sparse parts out
    2, 3, 2, 3 (shares 1.5x apart) and 4-bit's at 3M 6, 5, 6, 6."""
    codec = get_codec(name).at_round(0)
    for numel in (3_000_000, 10_400_000, 41_600_000, 10**9):
        for reducers in (2, 3, 4, 16):
            parts, values = _shares(numel, codec, reducers)
            assert len(set(parts)) == 1, (numel, reducers, parts)
            drift = parts[0] * reducers * codec.block  # a part rounds up to a block: the last share is shorter
            assert max(values) - min(values) <= drift, (numel, reducers, values)
            assert max(values) / min(values) <= 1.02, (numel, reducers, values)
    _, values = _shares(10_400_000, codec, 4)  # a fragment of the 41.6M-value WAN benchmark
    assert max(values) / min(values) <= 1.001


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_codec_that_reads_no_dither_says_so(name: str) -> None:
    """A reducer draws a round's dither only for a codec whose unbiased encoding reads it
    (``Codec.stochastic``); for any other, that encoding is its plain one, without a dither."""
    codec = get_codec(name).at_round(3)
    x = torch.randn(1000) * 1e-2
    reads_dither = type(codec).encode_unbiased is not Codec.encode_unbiased
    assert codec.stochastic is reads_dither
    if not codec.stochastic:
        assert codec.encode_unbiased(x, torch.empty(0)) == codec.encode(x)
    else:  # a different dither, different roundings
        first, second = torch.rand(1100), torch.rand(1100)
        assert codec.encode_unbiased(x, first) != codec.encode_unbiased(x, second)
