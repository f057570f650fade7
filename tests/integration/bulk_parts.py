"""What the bulk channel's tests share (``test_bulk_channel``, ``test_bulk_link``): a handler that
echoes parts, a part, a call of several parts over a link, and a test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from engine.bulk_link import BulkLink


class Echo:
    """A handler that answers each part with its own bytes, and remembers what it was sent."""

    def __init__(self) -> None:
        self.calls: list[PeerID] = []
        self.parts: list[bytes] = []

    async def __call__(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        self.calls.append(context.remote_id)
        async for message in stream:
            self.parts.append(message.tensor_part.buffer)
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=message.tensor_part)


def part(payload: bytes) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", tensor_part=runtime_pb2.Tensor(buffer=payload)
    )


async def call(link: BulkLink, payloads: list[bytes]) -> list[bytes]:
    """One call of ``payloads`` over ``link``: the answers, its request stream kept open until
    every answer is in (as a sender's is)."""
    sent = asyncio.Event()

    async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
        for payload in payloads:
            yield part(payload)
        await sent.wait()

    answers = link.call(requests())
    got = []
    try:
        async for message in answers:
            got.append(message.tensor_part.buffer)
            if len(got) == len(payloads):
                break
    finally:
        sent.set()
        await answers.aclose()
    return got


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))
