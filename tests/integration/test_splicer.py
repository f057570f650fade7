"""Splices in a process of their own (``relay.splicer``): what a relay tunnel, a punched
connection or a volunteer's relay carries goes through the splice process byte for byte, the
bytes already buffered included, both directions to their end; a splice process that dies ends
its splices and the next splice starts another; cancelling a splice ends its connections."""

from __future__ import annotations

import asyncio
import os
import signal

from relay.splicer import Splicer

EARLY = b"sent before the hand-over " * 100
BODY = os.urandom(3 * 2**20)
REPLY = b"the far end's answer " * 5000


async def _far_end(received: bytearray) -> asyncio.Server:
    """A server that reads everything it is sent, then answers and closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read())
        writer.write(REPLY)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _spliced_pair(
    splicer: Splicer, far_port: int, counts: tuple[list[int], list[int]]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None]]:
    """A client connected to a middle that splices it to the far end through ``splicer``; the
    client's first bytes reach the middle before the splice starts (buffered there)."""
    ready = asyncio.Event()
    splices: list[asyncio.Task[None]] = []

    async def middle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)  # the middle's own handshake, as a relay's Take
        far = await asyncio.open_connection("127.0.0.1", far_port)
        await asyncio.sleep(0.2)  # EARLY is in this reader's buffer by now
        task = asyncio.current_task()
        assert task is not None
        splices.append(task)
        ready.set()
        await splicer.pipe_both((reader, writer), far, counts)

    server = await asyncio.start_server(middle, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    before = splicer.started + (splicer.pid is not None)
    writer.write(b"hello" + EARLY)
    await writer.drain()
    await ready.wait()
    server.close()
    for _ in range(200):  # until the splice process runs (it starts at the first hand-over)
        if splicer.pid is not None and splicer.started + 1 > before:
            break
        await asyncio.sleep(0.05)
    return reader, writer, splices[0]


def test_a_splice_carries_both_directions_to_their_end_in_another_process() -> None:
    async def main() -> None:
        splicer = Splicer()
        received = bytearray()
        far = await _far_end(received)
        counts: tuple[list[int], list[int]] = ([0], [0])
        try:
            reader, writer, splice = await _spliced_pair(splicer, far.sockets[0].getsockname()[1], counts)
            assert splicer.pid is not None and splicer.pid != os.getpid()
            writer.write(BODY)
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 30)
            await asyncio.wait_for(splice, 30)
            assert bytes(received) == EARLY + BODY
            assert answer == REPLY
            assert counts == ([len(EARLY) + len(BODY)], [len(REPLY)])
            assert splicer.started == 1
        finally:
            far.close()
            splicer.close()
        assert splicer.pid is None

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_dead_splice_process_ends_its_splices_and_the_next_starts_another() -> None:
    async def main() -> None:
        splicer = Splicer()
        received = bytearray()
        far = await _far_end(received)
        port = far.sockets[0].getsockname()[1]
        try:
            reader, writer, splice = await _spliced_pair(splicer, port, ([0], [0]))
            pid = splicer.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(splice, 30)  # ended, not hung
            assert await asyncio.wait_for(reader.read(), 30) == b""  # its connection went with it
            writer.close()
            reader, writer, splice = await _spliced_pair(splicer, port, ([0], [0]))
            assert splicer.started == 2 and splicer.pid != pid
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 30) == REPLY
            await asyncio.wait_for(splice, 30)
        finally:
            far.close()
            splicer.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cancelling_a_splice_ends_its_connections() -> None:
    async def main() -> None:
        splicer = Splicer()
        far = await _far_end(bytearray())
        try:
            reader, writer, splice = await _spliced_pair(splicer, far.sockets[0].getsockname()[1], ([0], [0]))
            splice.cancel()
            assert await asyncio.wait_for(reader.read(), 30) == b""
            writer.close()
        finally:
            far.close()
            splicer.close()

    asyncio.run(asyncio.wait_for(main(), 60))
