"""``PartBuffers``: a reducer's decoded parts come from buffers it reuses part after part, and
an average never aliases a buffer that the next part overwrites."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.allreduce import CodecCompression, RobustPartReducer
from engine.codecs import get_codec
from engine.part_buffers import PartBuffers
from engine.robust import RobustRule
from protocol.errors import MalformedTensorError


def test_a_buffer_given_back_is_the_next_one_taken() -> None:
    buffers = PartBuffers()
    first = buffers.take(8)
    buffers.give([first])
    assert len(buffers) == 1
    again = buffers.take(8)
    assert again.data_ptr() == first.data_ptr() and buffers.allocated == 1
    other = buffers.take(4)  # another length: fresh
    assert other.numel() == 4 and buffers.allocated == 2


def test_the_pool_keeps_no_more_than_its_bound() -> None:
    buffers = PartBuffers(max_free=2)
    buffers.give([torch.empty(4) for _ in range(5)])
    assert len(buffers) == 2
    buffers.clear()
    assert len(buffers) == 0


@pytest.mark.parametrize("bad", [torch.empty(4, dtype=torch.float64), torch.empty(2, 2), torch.empty(8)[::2]])
def test_only_flat_float32_buffers_go_back(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="not a buffer"):
        PartBuffers().give([bad])


def test_a_failed_decode_gives_its_buffer_back_and_raises() -> None:
    buffers = PartBuffers()

    def refuse(out: torch.Tensor) -> None:
        out.fill_(1.0)
        raise MalformedTensorError("payload decodes to NaN or Inf")

    with pytest.raises(MalformedTensorError):
        buffers.decoded(16, refuse)
    assert len(buffers) == 1
    assert buffers.decoded(16, lambda out: out.zero_()).eq(0).all()
    assert buffers.allocated == 1


@pytest.mark.parametrize("name", ["fp16", "int8", "4bit", "sparse"])
def test_a_sent_part_decodes_into_a_reused_buffer_as_it_decodes_fresh(name: str) -> None:
    codec = CodecCompression(get_codec(name).at_round(3))
    buffers = PartBuffers()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    serialized = codec.compress(x, None)  # type: ignore[arg-type]
    for _ in range(2):
        part = codec.decode_sent_reused(buffers, serialized, x.numel())
        assert torch.equal(part, codec.decode_sent(serialized, x.numel()))
        buffers.give([part])
    assert buffers.allocated == 1
    with pytest.raises(MalformedTensorError, match="values, expected"):
        codec.decode_sent_reused(buffers, serialized, x.numel() + 64)  # a sender's part of another length


def test_a_reducer_reuses_its_senders_buffers_and_its_averages_stay_put() -> None:
    """Three parts from two senders: the second and third parts' decodes land in the first's
    buffers, and every average handed out is still what it was when the last part is done."""
    buffers = PartBuffers()

    async def scenario() -> tuple[RobustPartReducer, list[torch.Tensor]]:
        reducer = RobustPartReducer((torch.Size([64]),) * 3, 2, RobustRule.off(), buffers)
        averages = []
        for part in range(3):
            low = buffers.decoded(64, lambda out, p=part: out.fill_(float(p)))
            high = buffers.decoded(64, lambda out, p=part: out.fill_(float(p) + 2.0))
            mine, theirs = await asyncio.gather(
                reducer.accumulate_part(0, part, low), reducer.accumulate_part(1, part, high)
            )
            assert mine is theirs
            averages.append(mine)
        return reducer, averages

    reducer, averages = asyncio.run(scenario())
    assert buffers.allocated == 2, "the later parts reused the first part's buffers"
    for part, average in enumerate(averages):
        assert torch.equal(average, torch.full((64,), float(part) + 1.0)), part
    assert reducer.finished.is_set() and len(buffers) == 0, "a finished reducer lets its buffers go"
