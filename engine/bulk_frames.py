"""Frames of the bulk channel (``engine.bulk_channel``): what one TLS connection between two
members carries, on asyncio streams.

One connection per pair of members carries every call between them at once, both ways (one
per fragment averaged and direction, ``engine.bulk_link``), each call named by a number its
caller picks: the dialler's odd, the acceptor's even, each rising. A frame is a kind (1 byte),
the call (4 bytes), a length (4 bytes; all big-endian) and that many bytes. The kinds:

- ``HELLO`` (call 0): the dialler's first frame, its ticket's token; the acceptor answers with an
  empty ``HELLO`` once it accepted it (``engine.bulk_server``);
- ``DATA``: one ``AveragingData`` message (a part to the reducer, an averaged part back); a
  call's first frame;
- ``END``: the end of one side's messages in a call (a request stream's end, or the reducer's
  handler finished);
- ``CLOSE``: the caller has read what it wanted of a call and closed it (as a libp2p reader
  closing its stream: the reducer's handler is cancelled if still waiting);
- ``CREDIT``: the reader of a call took ``n`` of its messages (a 4-byte count): the other side
  may send ``n`` more.

Each side may send ``WINDOW`` ``DATA`` frames of a call before the other's first ``CREDIT``, and
never more than it was credited: a reader then never waits on one call with another's frames
behind it (one connection, no head-of-line blocking), and never holds more than ``WINDOW`` parts
per call. A side that sends past its credit breaks the protocol.

A length over ``MAX_FRAME_BYTES``, an unknown kind or a frame out of place is a
``FrameError``: the connection is dropped with every call on it, nothing read from it counts.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
from typing import Protocol

__all__ = [
    "MAX_CALL",
    "MAX_FRAME_BYTES",
    "WINDOW",
    "Credit",
    "FrameError",
    "Frames",
    "Kind",
    "keep_alive",
    "read_frame",
    "read_count",
    "write_credit",
    "write_frame",
]

MAX_FRAME_BYTES = 16 * 2**20
"""The largest frame either side accepts: a part is at most ``engine.allreduce.PART_SIZE_BYTES``
(1 MiB) on the wire, a sparse codec's a few times that at worst, plus the message's fields."""
WINDOW = 8
"""``DATA`` frames of one call in flight each way before the reader credits them: 8 parts of
1 MiB keep one call moving at up to 8 MiB per round trip (560 Mbit/s at 120 ms), and four
fragments at once four times that; a reducer holds at most this many parts per call unread."""
MAX_CALL = 2**32 - 1

_HEADER = struct.Struct(">BII")
_COUNT = struct.Struct(">I")


class Kind(enum.IntEnum):
    HELLO = 1
    DATA = 2
    END = 3
    CLOSE = 4
    CREDIT = 5


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


class Frames(Protocol):
    """What frames are read from: ``engine.bulk_reader.FrameReader`` on a bulk connection."""

    async def read(self, limit: int = MAX_FRAME_BYTES) -> tuple[Kind, int, bytes | bytearray]: ...


async def read_frame(
    reader: asyncio.StreamReader | Frames, limit: int = MAX_FRAME_BYTES
) -> tuple[Kind, int, bytes | bytearray]:
    """The next frame: its kind, call and payload; ``asyncio.IncompleteReadError`` at the end of
    the stream, ``FrameError`` for a frame this protocol does not have. From a ``StreamReader``
    (a test's raw connection) or a bulk connection's ``Frames``."""
    if not isinstance(reader, asyncio.StreamReader):
        return await reader.read(limit)
    header = await reader.readexactly(_HEADER.size)
    kind, call, length = _HEADER.unpack(header)
    if length > limit:
        raise FrameError(f"a frame of {length} bytes (at most {limit})")
    try:
        known = Kind(kind)
    except ValueError:
        raise FrameError(f"a frame of unknown kind {kind}") from None
    payload = await reader.readexactly(length) if length else b""
    return known, call, payload


def write_frame(writer: asyncio.StreamWriter, kind: Kind, payload: bytes = b"", call: int = 0) -> None:
    """Queue one whole frame on ``writer`` (the caller drains): frames of several calls written
    from several tasks never interleave."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(payload)} bytes (at most {MAX_FRAME_BYTES})")
    header = _HEADER.pack(kind, call, len(payload))
    # one call, so that TLS sends the frame in one go (two writes: the header in a record and a
    # packet of its own); never interleaved with another task's frames (no await in between)
    writer.writelines((header, payload) if payload else (header,))


def write_credit(writer: asyncio.StreamWriter, call: int, count: int = 1) -> None:
    write_frame(writer, Kind.CREDIT, _COUNT.pack(count), call)


def read_count(payload: bytes | bytearray) -> int:
    """A ``CREDIT`` frame's count; ``FrameError`` for anything but a positive 4-byte count."""
    if len(payload) != _COUNT.size or (count := _COUNT.unpack(payload)[0]) == 0:
        raise FrameError("a CREDIT frame without a positive count")
    return int(count)


class Credit:
    """``DATA`` frames one side of a call may still send: ``WINDOW`` at first, more as the other
    side credits them; ``take`` waits for one."""

    def __init__(self, window: int = WINDOW) -> None:
        self.left = window
        self._more = asyncio.Event()
        self._more.set()

    def grant(self, count: int) -> None:
        self.left += count
        self._more.set()

    async def take(self) -> None:
        while self.left <= 0:
            self._more.clear()
            await self._more.wait()
        self.left -= 1


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 15, 4
"""TCP keepalive on every bulk connection, both ends: a kept connection stays in the NAT tables
and firewalls on its path between rounds (minutes apart), and one whose path died is found
(about 2 minutes) and dropped from the pool before a round sends parts into it."""


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn on TCP keepalive for ``writer``'s socket (where the platform has the options)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
