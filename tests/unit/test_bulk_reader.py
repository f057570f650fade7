"""A bulk connection's frames as its protocol reads them (``engine.bulk_reader``): whatever the
chunks TLS hands over, the same frames as ``read_frame`` over a stream; a frame the protocol
does not have refused on its header, before anything is allocated for its payload; a reader
that does not keep up pauses the socket."""

from __future__ import annotations

import asyncio
import random
import struct

import pytest

from engine.bulk_frames import MAX_FRAME_BYTES, FrameError, Kind
from engine.bulk_reader import BUFFERED_BYTES, FrameProtocol

HEADER = struct.Struct(">BII")


def frame(kind: Kind, call: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, call, len(payload)) + payload


class Transport(asyncio.Transport):
    """What the protocol asks of its transport: pausing and resuming reads."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.closing = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing


def protocol(**kwargs: int) -> tuple[FrameProtocol, Transport]:
    made = FrameProtocol(**kwargs)
    transport = Transport()
    made.connection_made(transport)
    return made, transport


def feed(made: FrameProtocol, data: bytes, cuts: list[int]) -> None:
    start = 0
    for end in [*cuts, len(data)]:
        made.data_received(data[start:end])
        start = end


def test_frames_come_whole_and_in_order_whatever_the_chunks() -> None:
    rng = random.Random(7)
    frames = [
        (Kind.HELLO, 0, rng.randbytes(32)),
        (Kind.DATA, 1, rng.randbytes(200_000)),
        (Kind.CREDIT, 1, (3).to_bytes(4, "big")),
        (Kind.END, 1, b""),
        (Kind.DATA, 3, rng.randbytes(9)),
        (Kind.CLOSE, 3, b""),
    ]
    wire = b"".join(frame(*f) for f in frames)

    async def main() -> None:
        for cuts in ([], [1, 2, 9, 10, 41, 50], sorted(rng.sample(range(1, len(wire)), 300))):
            made, _ = protocol()
            feed(made, wire, cuts)
            made.eof_received()
            got = [await made.reader.read() for _ in frames]
            assert [(k, c, bytes(p)) for k, c, p in got] == frames
            with pytest.raises(asyncio.IncompleteReadError):  # the end, at a frame's boundary
                await made.reader.read()
        # one byte at a time
        made, _ = protocol()
        small = wire[:200] + frame(Kind.END, 5)
        for i in range(len(small)):
            made.data_received(small[i : i + 1])
        assert (await made.reader.read())[0] == Kind.HELLO

    asyncio.run(main())


def test_a_frame_over_the_limit_or_of_an_unknown_kind_is_refused_on_its_header() -> None:
    async def main() -> None:
        made, transport = protocol()
        huge = HEADER.pack(Kind.DATA, 7, MAX_FRAME_BYTES + 1)
        made.data_received(frame(Kind.END, 5) + huge + b"x" * 100)
        assert made._payload is None, "nothing allocated for a frame over the limit"
        assert transport.paused, "nothing more read from the socket"
        assert await made.reader.read() == (Kind.END, 5, b"")  # the frames before it still count
        with pytest.raises(FrameError, match="at most"):
            await made.reader.read()
        with pytest.raises(FrameError, match="at most"):  # and every later read
            await made.reader.read()

        made, _ = protocol()
        made.data_received(HEADER.pack(9, 1, 0))
        with pytest.raises(FrameError, match="unknown kind"):
            await made.reader.read()

        # a listener's first frame is a token: one claiming more is refused before its bytes
        made, _ = protocol(first=32)
        made.data_received(HEADER.pack(Kind.HELLO, 0, 33))
        assert made._payload is None
        with pytest.raises(FrameError, match="at most 32"):
            await made.reader.read()
        # after a first frame of a token's size, a part's size is taken
        made, _ = protocol(first=32)
        made.data_received(frame(Kind.HELLO, 0, b"t" * 32) + frame(Kind.DATA, 1, b"p" * 1000))
        assert bytes((await made.reader.read(limit=32))[2]) == b"t" * 32
        assert bytes((await made.reader.read())[2]) == b"p" * 1000
        # and a read's own limit holds too
        made, _ = protocol()
        made.data_received(frame(Kind.DATA, 1, b"p" * 10))
        with pytest.raises(FrameError, match="at most 0"):
            await made.reader.read(limit=0)

    asyncio.run(main())


def test_the_end_of_the_stream_mid_frame_or_a_broken_connection_is_raised_after_the_frames() -> None:
    async def main() -> None:
        made, _ = protocol()
        made.data_received(frame(Kind.END, 1) + frame(Kind.DATA, 3, b"abcdef")[:-2])
        made.eof_received()
        assert await made.reader.read() == (Kind.END, 1, b"")
        with pytest.raises(asyncio.IncompleteReadError) as cut:
            await made.reader.read()
        assert (cut.value.partial, cut.value.expected) == (b"abcd", 6)

        made, _ = protocol()
        made.data_received(frame(Kind.END, 1) + b"\x02\x00")
        made.connection_lost(ConnectionResetError("reset"))
        assert await made.reader.read() == (Kind.END, 1, b"")
        with pytest.raises(ConnectionResetError):
            await made.reader.read()
        await asyncio.wait_for(made._get_close_waiter(None), 1)  # a writer's wait_closed ends

    asyncio.run(main())


def test_a_reader_waiting_wakes_for_the_next_frame_and_may_be_cancelled() -> None:
    async def main() -> None:
        made, _ = protocol()
        waiting = asyncio.ensure_future(made.reader.read())
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiting), 0.05)
        made.data_received(frame(Kind.END, 9))
        assert await asyncio.wait_for(waiting, 1) == (Kind.END, 9, b"")
        with pytest.raises(TimeoutError):  # cancelled while it waits: nothing lost
            await asyncio.wait_for(made.reader.read(), 0.05)
        made.data_received(frame(Kind.CLOSE, 9))
        assert await asyncio.wait_for(made.reader.read(), 1) == (Kind.CLOSE, 9, b"")

    asyncio.run(main())


def test_frames_not_taken_pause_the_socket_until_they_are() -> None:
    async def main() -> None:
        made, transport = protocol()
        part = b"p" * 2**20
        sent = BUFFERED_BYTES // len(part) + 1
        made.data_received(b"".join(frame(Kind.DATA, 1, part) for _ in range(sent)))
        assert transport.paused
        taken = 0
        while transport.paused:
            await made.reader.read()
            taken += 1
        assert taken >= 1 and (sent - taken) * len(part) <= BUFFERED_BYTES // 2
        # a closing transport is not resumed
        made, transport = protocol()
        made.data_received(b"".join(frame(Kind.DATA, 1, part) for _ in range(sent)))
        transport.closing = True
        for _ in range(sent):
            await made.reader.read()
        assert transport.paused

    asyncio.run(main())
