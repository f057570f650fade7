"""SparseLoCo's codec, the quality benchmark's reference (``benchmarks.topk_reference``): each
chunk's top 64 by magnitude in 2 bits at their positions, decoded from its bytes; its error
feedback decays."""

from __future__ import annotations

import pytest
import torch

from benchmarks.topk_reference import CHUNK, DECAY, DecayedFeedback, K, TopKCodec
from engine.compression import TwoBitCodec
from protocol.errors import MalformedTensorError


@pytest.mark.parametrize("n", [0, 10, CHUNK, CHUNK + 100, 3 * CHUNK + 1])
def test_each_chunk_sends_its_largest_values_and_decode_is_the_roundtrip(n: int) -> None:
    codec = TopKCodec()
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(n)
    out = codec.decode(data, n)
    assert torch.equal(out, codec.roundtrip(x))
    for start in range(0, n, CHUNK):
        chunk, sent = x[start : start + CHUNK], out[start : start + CHUNK]
        top = torch.topk(chunk.abs(), min(K, chunk.numel())).indices
        assert set(torch.nonzero(sent).view(-1).tolist()) <= set(top.tolist())
        assert torch.equal(sent[top.sort().values], TwoBitCodec().roundtrip(chunk[top.sort().values]))


def test_positions_out_of_order_or_out_of_the_chunk_are_refused() -> None:
    codec = TopKCodec()
    data = bytearray(codec.encode(torch.randn(CHUNK)))
    data[0:4] = data[2:4] + data[0:2]  # the first two positions swapped
    with pytest.raises(MalformedTensorError, match="ascending"):
        codec.decode(bytes(data), CHUNK)


def test_the_feedback_decays_what_it_carries() -> None:
    feedback = DecayedFeedback(TopKCodec(), CHUNK)
    feedback.load_residual(torch.ones(CHUNK))
    out = torch.zeros(CHUNK)
    feedback.add_into(out, 0)
    assert torch.equal(out, torch.full((CHUNK,), DECAY))
