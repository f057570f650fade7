"""What the bulk channel's tests share (``test_bulk_channel``, ``test_bulk_link``): a handler that
echoes parts, and a part."""

from __future__ import annotations

from collections.abc import AsyncIterator

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2


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
