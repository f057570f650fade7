"""``RobustPartReducer``: one sender's cancelled handler does not fail a part for the others.

A sender whose peer dies mid all-reduce has its handler task cancelled (p2pd closes its
stream) while it waits for the part it already contributed to. The part is shared by every
sender; cancelling the wait must cancel only that sender's wait.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from engine.allreduce import RobustPartReducer
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
