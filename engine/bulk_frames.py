"""Frames of the bulk channel (``engine.bulk_channel``): what one TLS connection between two
members carries, on asyncio streams.

A frame is a kind (1 byte), a length (4 bytes, big-endian) and that many bytes. The kinds:

- ``HELLO``: the sender's first frame, its ticket's token; the reducer answers with an empty
  ``HELLO`` once it accepted it (``engine.bulk_server``);
- ``DATA``: one ``AveragingData`` message (a part to the reducer, an averaged part back);
- ``END``: the end of one side's messages for the current call (a request stream's end, or
  the reducer's handler finished);
- ``CLOSE``: the sender has read what it wanted of the current call and closed it (as a
  libp2p reader closing its stream: the reducer's handler is cancelled if still waiting).

A length over ``MAX_FRAME_BYTES`` or an unknown kind is a ``FrameError``: the connection is
dropped, nothing read from it counts.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct

__all__ = ["MAX_FRAME_BYTES", "FrameError", "Kind", "keep_alive", "read_frame", "write_frame"]

MAX_FRAME_BYTES = 16 * 2**20
"""The largest frame either side accepts: a part is at most ``engine.allreduce.PART_SIZE_BYTES``
(1 MiB) on the wire, a sparse codec's a few times that at worst, plus the message's fields."""

_HEADER = struct.Struct(">BI")


class Kind(enum.IntEnum):
    HELLO = 1
    DATA = 2
    END = 3
    CLOSE = 4


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> tuple[Kind, bytes]:
    """The next frame; ``asyncio.IncompleteReadError`` at the end of the stream, ``FrameError``
    for a frame this protocol does not have."""
    header = await reader.readexactly(_HEADER.size)
    kind, length = _HEADER.unpack(header)
    if length > limit:
        raise FrameError(f"a frame of {length} bytes (at most {limit})")
    try:
        known = Kind(kind)
    except ValueError:
        raise FrameError(f"a frame of unknown kind {kind}") from None
    payload = await reader.readexactly(length) if length else b""
    return known, payload


def write_frame(writer: asyncio.StreamWriter, kind: Kind, payload: bytes = b"") -> None:
    """Queue one frame on ``writer`` (the caller drains)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(payload)} bytes (at most {MAX_FRAME_BYTES})")
    writer.write(_HEADER.pack(kind, len(payload)))
    if payload:
        writer.write(payload)


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
