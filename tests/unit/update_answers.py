"""A member's scripted answer to an update or state request (``_Answer``), for the transfer tests."""

from __future__ import annotations

from typing import Any


class _Answer:
    """What ``_download_update`` hands its result to (an ``MPFuture`` in the averager)."""

    def __init__(self) -> None:
        self.result: Any = "unset"

    def set_result(self, value: Any) -> None:
        self.result = value

    def done(self) -> bool:
        return self.result != "unset"
