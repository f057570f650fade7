"""``RobustPartReducer``: one sender's cancelled handler does not fail a part for the others.

A sender whose peer dies mid all-reduce has its handler task cancelled (p2pd closes its
stream) while it waits for the part it already contributed to. The part is shared by every
sender; cancelling the wait must cancel only that sender's wait.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import NoCompression

from engine.allreduce import InPlaceOutputs, RobustPartReducer
from engine.robust import RobustRule


def test_a_cancelled_sender_leaves_the_part_to_the_others() -> None:
    async def scenario() -> list[torch.Tensor]:
        reducer = RobustPartReducer((torch.Size([4]), torch.Size([4])), 3, RobustRule.off())
        dying = asyncio.create_task(reducer.accumulate_part(2, 0, torch.full((4,), 3.0)))
        await asyncio.sleep(0)  # its part 0 is in and it waits for the others'
        dying.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dying
        reducer.on_sender_failed(2)  # what the handler's ban does
        first = asyncio.create_task(reducer.accumulate_part(0, 0, torch.full((4,), 1.0)))
        second = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((4,), 2.0)))
        part0 = await asyncio.gather(first, second)
        # part 1: only the two live senders count
        part1 = await asyncio.gather(
            reducer.accumulate_part(0, 1, torch.full((4,), 1.0)),
            reducer.accumulate_part(1, 1, torch.full((4,), 2.0)),
        )
        assert reducer.finished.is_set()
        return [*part0, *part1]

    part0_a, part0_b, part1_a, part1_b = asyncio.run(scenario())
    assert torch.equal(part0_a, torch.full((4,), 2.0))  # (1 + 2 + 3) / 3: its part 0 arrived before it died
    assert torch.equal(part0_a, part0_b)
    assert torch.equal(part1_a, torch.full((4,), 1.5))  # (1 + 2) / 2: it sent no part 1
    assert torch.equal(part1_a, part1_b)


def test_a_part_abandoned_by_the_reducer_is_a_clear_error() -> None:
    async def scenario() -> None:
        reducer = RobustPartReducer((torch.Size([4]),), 2, RobustRule.off())
        waiting = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        await asyncio.sleep(0)
        reducer.finalize()
        await waiting

    with pytest.raises(AllreduceException, match="abandoned"):
        asyncio.run(scenario())


def test_a_round_cancelled_mid_decode_ends_only_once_the_decode_wrote_its_last_value() -> None:
    """An averaged part is decoded by an executor's thread straight into the averaged vector;
    a round cancelled meanwhile must not let go of the vector while that thread still writes."""
    vector = torch.zeros(1 << 16)
    release = threading.Event()

    def decode_into(out: torch.Tensor) -> None:
        release.wait(10)
        out.fill_(7.0)

    async def scenario() -> bool:
        outputs = InPlaceOutputs([vector], (1.0,), compression=NoCompression(), part_size_bytes=vector.numel() * 4)
        round_ = asyncio.create_task(outputs.decode_part(0, 0, decode_into))
        await asyncio.sleep(0.05)
        round_.cancel()
        await asyncio.sleep(0.05)
        ended_early = round_.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await round_
        return ended_early

    assert not asyncio.run(scenario()), "the cancelled round ended while the decode still wrote into the vector"
    assert bool((vector == 7.0).all())


def test_an_averaged_part_is_written_into_its_range_only_in_its_turn() -> None:
    async def scenario() -> None:
        vector = torch.zeros(10)
        outputs = InPlaceOutputs([vector], (0.5, 0.5), compression=NoCompression(), part_size_bytes=8)
        (a, b), (c, d) = outputs.part_range(0, 0), outputs.part_range(0, 1)
        assert (a, b, c, d) == (0, 2, 2, 4)  # parts of 2 values (8 bytes), reducer 0's first
        with pytest.raises(ValueError, match="out of order"):
            outputs.output_of(0, 1)
        outputs.output_of(0, 0).fill_(1.0)
        outputs.register_written_part(0, 0)
        with pytest.raises(ValueError, match="out of order"):
            outputs.register_written_part(0, 0)  # a part counted twice
        outputs.output_of(0, 1).fill_(2.0)
        assert vector.tolist() == [1.0, 1.0, 2.0, 2.0] + [0.0] * 6  # nothing outside the two parts

    asyncio.run(scenario())
