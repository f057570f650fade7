"""``engine.stream_close.until_reader_closes``: a handler's stream stays open after its last
message until the reader closes it (hivemind cancels the handler then) or the wait runs out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.stream_close import until_reader_closes


async def _messages(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


def test_every_message_is_passed_on_then_the_stream_stays_open_until_the_wait_ends() -> None:
    async def run() -> tuple[list[int], float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = [m async for m in until_reader_closes(_messages(3), wait_s=0.2)]
        return got, loop.time() - started

    got, took = asyncio.run(run())
    assert got == [0, 1, 2]
    assert took >= 0.2


def test_the_readers_close_ends_the_wait_at_once() -> None:
    """hivemind runs a handler in a task and cancels it when the reader's close arrives."""

    async def run() -> tuple[list[int], bool, float]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        all_sent = asyncio.Event()

        async def handler() -> None:
            async for message in until_reader_closes(_messages(2), wait_s=60.0):
                got.append(message)
                if len(got) == 2:
                    all_sent.set()

        task = asyncio.create_task(handler())
        await all_sent.wait()
        await asyncio.sleep(0.05)
        still_open = not task.done()
        started = loop.time()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return got, still_open, loop.time() - started

    got, still_open, took = asyncio.run(run())
    assert got == [0, 1]
    assert still_open, "the handler ended right after its last message: p2pd would reset the stream"
    assert took < 1.0
