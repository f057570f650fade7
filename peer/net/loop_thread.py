"""Stopping an asyncio loop that runs on a thread of its own (a relay tunnel, the puncher)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_other_tasks() -> None:
    """Cancel every task of the running loop but the caller's, and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def stop_loop_thread(
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    what: str,
    cleanup: Callable[[], Coroutine[Any, Any, None]] = cancel_other_tasks,
) -> None:
    """Run ``cleanup`` on ``loop`` (5 s at most), then stop the loop and join its thread."""
    if not thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(cleanup(), loop).result(timeout=5)
    except (TimeoutError, concurrent.futures.CancelledError):
        logger.warning("%s: its tasks did not stop within 5 s", what)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
