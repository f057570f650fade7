"""The ``sparse`` codec (``engine.sparse_codec``): a round's shared mask, 4-bit values, no indices
on the wire; every position sent once in 1/density rounds; malformed payloads refused."""

from __future__ import annotations

import pytest
import torch

from engine.codecs import get_codec
from engine.compression import RESIDUAL_DTYPE, Codec, ErrorFeedback, FourBitCodec, TwoBitCodec
from engine.sparse_codec import DENSITIES, KEPT, SparseCodec, kept_positions
from protocol.errors import MalformedTensorError
from protocol.spec import AveragingSection


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("density", DENSITIES)
def test_every_position_is_kept_exactly_once_in_1_over_density_rounds(density: float) -> None:
    block = round(KEPT / density)
    seen = torch.zeros(block, dtype=torch.int64)
    for round_ in range(7, 7 + block // KEPT):  # any run of 1/density consecutive rounds
        positions = kept_positions(block, round_)
        assert positions.numel() == KEPT and bool((positions[1:] > positions[:-1]).all())
        seen[positions] += 1
    assert bool((seen == 1).all())


def test_a_rounds_positions_are_spread_over_the_block_not_a_run() -> None:
    positions = kept_positions(512, 3)
    assert int((positions[1:] - positions[:-1]).max()) <= 2 * 512 // KEPT


@pytest.mark.parametrize(("bits", "values"), [(2, TwoBitCodec), (4, FourBitCodec)])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 511, 512, 513, 1000, 4096 + 77])
def test_roundtrip_keeps_the_rounds_positions_in_its_bits_and_zeroes_the_rest(n: int, bits: int, values: type) -> None:
    codec = get_codec("sparse", bits=bits).at_round(11)
    x = _vector(n, seed=n)
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(n)
    out = codec.decode(data, n)
    assert torch.equal(out, codec.roundtrip(x))
    kept = codec.kept(n)
    assert torch.equal(out[kept], values().roundtrip(x[kept]))
    rest = torch.ones(n, dtype=torch.bool)
    rest[kept] = False
    assert not bool(out[rest].any())


def test_bytes_are_20_per_block_1_95_percent_of_fp32_by_default() -> None:
    codec = get_codec("sparse").at_round(0)
    assert (codec.block, codec.bits) == (256, 2)
    n = 256 * 1000
    assert len(codec.encode(_vector(n))) == 20 * 1000
    assert 20 * 1000 / (4 * n) == pytest.approx(0.0195, abs=1e-4)
    assert AveragingSection(compression="sparse").wire_bytes_per_value() * n == 20 * 1000
    four = SparseCodec(1 / 8, round_=0, bits=4)
    assert len(four.encode(_vector(512 * 10))) == 36 * 10
    assert AveragingSection(compression="sparse", density=1 / 8, bits=4).wire_bytes_per_value() * 512 == 36


def test_block_aligned_slices_encode_as_the_whole_does() -> None:
    codec = SparseCodec(1 / 8, round_=2)
    x = _vector(512 * 5 + 100, seed=4)
    whole = codec.roundtrip(x)
    cut = 512 * 3
    assert torch.equal(whole, torch.cat((codec.roundtrip(x[:cut]), codec.roundtrip(x[cut:]))))


def test_error_feedback_keeps_the_quantization_error_of_what_was_sent_and_nothing_for_the_rest() -> None:
    """A value the round did not send is left out of the round (its model keeps its progress,
    ``peer.round.host_passes``): its residual stays as it was; a sent one keeps what 4 bits dropped."""
    codec = SparseCodec(1 / 4, round_=None)
    n = 256 * 3 + 40
    feedback = ErrorFeedback(codec, n)
    before = (_vector(n, seed=3) * 1e-3).to(RESIDUAL_DTYPE).float()  # as the feedback stores it
    feedback.load_residual(before)
    delta = _vector(n, seed=9)
    sent = feedback.compensate(delta)
    bound = codec.at_round(2)
    feedback.update_slice(sent, 0, bound)
    unsent = bound.unsent(0, n)
    assert int((~unsent).sum()) == bound.kept(n).numel()
    assert torch.equal(feedback.residual[unsent], before[unsent])
    assert torch.equal(feedback.residual[~unsent], (sent - bound.roundtrip(sent)).to(RESIDUAL_DTYPE).float()[~unsent])


def test_the_unsent_mask_of_any_window_is_that_of_the_whole_vector() -> None:
    codec = SparseCodec(1 / 8, round_=9)
    whole = codec.unsent(0, 5000)
    assert torch.equal(~whole, torch.isin(torch.arange(5000), codec.kept(5000)))
    for start, count in ((0, 1), (511, 3), (1000, 2000), (4999, 1)):
        assert torch.equal(codec.unsent(start, count), whole[start : start + count])


def test_decode_depends_on_the_round_and_an_unbound_codec_refuses_to_work() -> None:
    x = _vector(1024, seed=1)
    a, b = SparseCodec(1 / 8, round_=0), SparseCodec(1 / 8, round_=1)
    assert not torch.equal(a.decode(a.encode(x), 1024), b.decode(a.encode(x), 1024))
    with pytest.raises(ValueError, match="bind it to a round"):
        get_codec("sparse").encode(x)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda data: data + b"\0",  # trailing bytes
        lambda data: data[:-1],  # short
        lambda data: b"",
        lambda data: b"\xff\xff\xff\x7f" + data[4:],  # a NaN scale
        lambda data: b"\0\0\x80\xbf" + data[4:],  # a negative scale (-1.0)
        lambda data: data[:-1] + b"\x00",  # a code 0 nibble: outside the alphabet
    ],
)
def test_malformed_payloads_are_refused(mangle: object) -> None:
    codec = SparseCodec(1 / 8, round_=5, bits=4)
    data = codec.encode(_vector(1024, seed=2))
    assert callable(mangle)
    with pytest.raises(MalformedTensorError):
        codec.decode(mangle(data), 1024)


def test_a_payload_of_another_length_is_refused() -> None:
    codec = SparseCodec(1 / 8, round_=5)
    with pytest.raises(MalformedTensorError):
        codec.decode(codec.encode(_vector(1024)), 2048)


@pytest.mark.parametrize("density", [0.0, 0.1, 1.0, 1 / 128, True, "1/8"])
def test_densities_outside_the_list_are_refused(density: object) -> None:
    with pytest.raises(ValueError, match="density must be one of"):
        SparseCodec(density)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda data: data + b"\0",
        lambda data: data[:-1],
        lambda data: b"\xff\xff\xff\x7f" + data[4:],  # a NaN scale
        lambda data: b"\0\0\x80\x7f" + data[4:],  # an infinite scale
    ],
)
def test_malformed_2bit_payloads_are_refused(mangle: object) -> None:
    codec = SparseCodec(1 / 4, round_=5, bits=2)
    data = codec.encode(_vector(1024 + 100, seed=2))
    assert callable(mangle)
    with pytest.raises(MalformedTensorError):
        codec.decode(mangle(data), 1024 + 100)


def test_a_2bit_pad_code_other_than_0_is_refused() -> None:
    codec = TwoBitCodec()
    data = bytearray(codec.encode(_vector(3)))
    data[-1] |= 0xC0  # the fourth code of the last byte pads the 3 values
    with pytest.raises(MalformedTensorError, match="pad"):
        codec.decode(bytes(data), 3)


def test_2bit_levels_round_to_nearest_and_stochastic_rounding_is_unbiased() -> None:
    codec = TwoBitCodec()
    x = torch.tensor([3.0, 1.0, -1.0, -3.0, 0.2, 2.1] + [0.0] * 58)
    assert codec.roundtrip(x)[:6].tolist() == [3.0, 1.0, -1.0, -3.0, 1.0, 3.0]
    draws = torch.stack([codec.decode(codec.encode_unbiased(x, torch.rand(64)), 64) for _ in range(4000)])
    assert torch.allclose(draws.mean(dim=0)[:6], x[:6], atol=0.1)


def test_the_spec_names_the_density_only_for_sparse() -> None:
    assert AveragingSection(compression="sparse").wire_bytes_per_value() == pytest.approx(20 / 256)
    with pytest.raises(ValueError, match="applies to compression"):
        AveragingSection(compression="4bit", density=1 / 8)
    with pytest.raises(ValueError, match="applies to compression"):
        AveragingSection(compression="int8", bits=2)
    with pytest.raises(ValueError, match="density must be one of"):
        AveragingSection(compression="sparse", density=0.3)


def test_the_sparse_error_written_in_place_is_the_generic_one_bit_for_bit() -> None:
    """``SparseCodec.write_error`` (kept columns only) against ``Codec.write_error`` (a dense
    roundtrip and a select), into a bfloat16 residual, with a partial last block."""
    codec = SparseCodec(1 / 4, round_=None).at_round(3)
    n = 256 * 40 + 77
    sent = _vector(n, seed=5)
    before = (_vector(n, seed=6) * 1e-3).to(RESIDUAL_DTYPE)
    fast, generic = before.clone(), before.clone()
    codec.write_error(sent, fast, 512)
    Codec.write_error(codec, sent, generic, 512)
    assert torch.equal(fast.view(torch.int16), generic.view(torch.int16))
    assert not torch.equal(fast, before)
    with pytest.raises(ValueError, match="not on a block"):
        codec.write_error(sent, fast, 100)


@pytest.mark.parametrize("name", ["sparse", "4bit", "int8", "fp16"])
@pytest.mark.parametrize("n", [1, 255, 256, 4096 + 77, 50_000])
def test_a_reducer_averaging_the_sent_values_alone_sends_the_same_bytes(name: str, n: int) -> None:
    """``decode_sent``/``encode_sent_unbiased`` (what a reducer averages: the kept values of a
    sparse part, all of a dense one) give the bytes the dense decode and ``encode_unbiased``
    give, and a mean of sent values is the dense mean's sent values, bit for bit."""
    codec = get_codec(name).at_round(5)
    parts = [codec.encode(_vector(n, seed=seed)) for seed in range(3)]
    dither = torch.rand(n + codec.block, generator=torch.Generator().manual_seed(9))
    dense = [codec.decode(data, n) for data in parts]
    sent = [codec.decode_sent(data, n) for data in parts]
    positions = codec.kept(n) if isinstance(codec, SparseCodec) else torch.arange(n)
    for whole, values in zip(dense, sent):
        assert torch.equal(whole[positions], values)
    dense_mean = (dense[0] * 0.5 + dense[1] * 0.25 + dense[2] * 0.25) / 1.0
    sent_mean = (sent[0] * 0.5 + sent[1] * 0.25 + sent[2] * 0.25) / 1.0
    assert codec.encode_sent_unbiased(sent_mean, n, dither) == codec.encode_unbiased(dense_mean, dither)
    if isinstance(codec, SparseCodec):
        with pytest.raises(ValueError, match="sent values"):  # a dense vector is not its sent values
            codec.encode_sent_unbiased(torch.zeros(positions.numel() + 1), n, dither)
