"""A reducer's encoding of an averaged part is held until every sender still in the round for
that part took it, and no longer (``engine.averaged_encodings``)."""

from __future__ import annotations

import asyncio
import math

from hivemind.proto import runtime_pb2

from engine.averaged_encodings import AveragedEncodings

IN = math.inf


def encoder(calls: list[int]):  # type: ignore[no-untyped-def]
    def encode() -> asyncio.Future[runtime_pb2.Tensor]:
        calls.append(1)
        future: asyncio.Future[runtime_pb2.Tensor] = asyncio.get_running_loop().create_future()
        future.set_result(runtime_pb2.Tensor(buffer=b"x" * 8))
        return future

    return encode


def test_one_encoding_is_shared_and_let_go_after_the_last_sender() -> None:
    async def main() -> None:
        calls: list[int] = []
        held = AveragedEncodings()
        first = held.future(0, encoder(calls))
        assert held.future(0, encoder(calls)) is first and len(calls) == 1
        held.future(1, encoder(calls))
        held.taken(0, [IN, IN, IN])
        held.taken(0, [IN, IN, IN])
        assert len(held) == 2  # a third sender has not taken part 0 yet
        held.taken(0, [IN, IN, IN])
        assert len(held) == 1  # part 1 is still held
        assert held.future(0, encoder(calls)) is not first and len(calls) == 3  # asked again: encoded again

    asyncio.run(main())


def test_a_sender_that_failed_before_a_part_is_not_waited_for() -> None:
    async def main() -> None:
        held = AveragedEncodings()
        held.future(3, encoder([]))
        held.taken(3, [IN, 2, IN])  # the second sender failed after 2 parts: 2 senders take part 3
        assert len(held) == 1
        held.taken(3, [IN, 2, IN])
        assert len(held) == 0
        held.future(1, encoder([]))
        held.taken(1, [IN, 2, IN])  # it got part 1 in, so part 1 waits for it
        held.taken(1, [IN, 2, IN])
        assert len(held) == 1
        held.clear()
        assert len(held) == 0

    asyncio.run(main())
