"""The small msgpack lists our averager RPCs carry in hivemind's spare ``AveragingData.peer_id``
field (audit requests and verdicts, update requests and headers), read one way: a size cap
before anything is parsed, then exactly the expected number of fields, or nothing."""

from __future__ import annotations

from typing import Any


def read_fields(serializer: Any, raw: bytes, count: int, max_bytes: int) -> list[Any] | None:
    """The ``count`` fields serialized in ``raw`` (at most ``max_bytes``); None if not that."""
    if len(raw) > max_bytes:
        return None
    try:
        values = serializer.loads(raw)
    except Exception:  # noqa: BLE001 - anything unreadable is refused
        return None
    return list(values) if isinstance(values, list | tuple) and len(values) == count else None
