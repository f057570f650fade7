"""A part's wire shape comes from another peer: it is checked before any arithmetic on it
(``engine.allreduce.part_numel``), so a shape of thousands of entries is refused at once, as a
malformed part (its sender is then named: ``ExactAllReduceRunner.refused_senders``)."""

from __future__ import annotations

import pytest
import torch
from hivemind.proto import runtime_pb2

import engine.allreduce as allreduce
from engine.allreduce import MAX_PART_DIMS, MAX_PART_VALUES, CodecCompression
from engine.codecs import get_codec
from protocol.errors import MalformedTensorError


def _part(size: list[int]) -> runtime_pb2.Tensor:
    compression = CodecCompression(get_codec("int8"))
    honest = compression.compress(torch.ones(256), info=None)
    return runtime_pb2.Tensor(buffer=honest.buffer, size=size, dtype=honest.dtype)


@pytest.fixture
def no_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any product over a hostile shape fails the test (40,000 ones took 12 s of the GIL)."""

    def refuse(*_args: object, **_kwargs: object) -> int:
        raise AssertionError("math.prod ran over a shape that should have been refused first")

    monkeypatch.setattr(allreduce.math, "prod", refuse)


@pytest.mark.parametrize(
    "size",
    [[1] * 40_000, [2**20] * (MAX_PART_DIMS + 1), [MAX_PART_VALUES + 1], [2**32 - 1, 2**32 - 1]],
    ids=["40k dims", "too many dims", "too many values", "huge dims"],  # (the wire's dims are uint32)
)
def test_a_hostile_shape_is_refused_as_malformed_before_any_arithmetic(size: list[int], no_arithmetic: None) -> None:
    compression = CodecCompression(get_codec("int8"))
    with pytest.raises(MalformedTensorError, match="dimension"):
        compression.decode(_part(size), expected_numel=256)


def test_an_honest_part_still_decodes() -> None:
    compression = CodecCompression(get_codec("int8"))
    part = compression.decode(_part([256]), expected_numel=256)
    assert part.shape == (256,) and torch.allclose(part, torch.ones(256), atol=0.01)


def test_a_well_formed_shape_of_the_wrong_size_is_refused() -> None:
    compression = CodecCompression(get_codec("int8"))
    with pytest.raises(MalformedTensorError, match="has 16 values, expected 256"):
        compression.decode(_part([4, 4]), expected_numel=256)
