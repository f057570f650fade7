"""The relay's wire: how a peer behind NAT gets a public port on a relay and takes the
connections that arrive there (``protocol.relay_server`` serves it, ``peer.relay_client`` uses it).

A peer that nobody can dial keeps one *control* connection open to the relay. It sends
``Open(token)`` (its access token: only admitted peers get a port) and the relay answers
``Granted(port)``: from then on ``relay-host:port`` is the peer's public address, which it
announces in the swarm. Each connection that arrives on that port is announced on the control
connection as ``Incoming(id)``; the peer opens a new connection to the relay, sends
``Take(id)``, and the relay splices the two: the bytes of libp2p's own encrypted session pass
through unchanged. ``Ping`` keeps the control connection alive both ways; ``Refused(reason)``
ends it. Every message is a one-byte type and a fixed or length-prefixed body, read with a
bound, so a malformed one is a ``MalformedMessageError`` and never a large allocation.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from protocol.errors import MalformedMessageError

MAX_TOKEN_BYTES = 4096
MAX_REASON_BYTES = 512

OPEN, GRANTED, INCOMING, TAKE, PING, REFUSED = b"O", b"G", b"I", b"T", b"P", b"R"


@dataclass(frozen=True)
class Open:
    token: bytes


@dataclass(frozen=True)
class Granted:
    port: int


@dataclass(frozen=True)
class Incoming:
    conn_id: int


@dataclass(frozen=True)
class Take:
    conn_id: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Refused:
    reason: str


Message = Open | Granted | Incoming | Take | Ping | Refused


def encode(message: Message) -> bytes:
    """The bytes of ``message`` on the wire."""
    if isinstance(message, Open):
        if not 0 < len(message.token) <= MAX_TOKEN_BYTES:
            raise ValueError(f"a token is 1-{MAX_TOKEN_BYTES} bytes, got {len(message.token)}")
        return OPEN + struct.pack(">H", len(message.token)) + message.token
    if isinstance(message, Granted):
        return GRANTED + struct.pack(">H", message.port)
    if isinstance(message, Incoming):
        return INCOMING + struct.pack(">Q", message.conn_id)
    if isinstance(message, Take):
        return TAKE + struct.pack(">Q", message.conn_id)
    if isinstance(message, Ping):
        return PING
    reason = message.reason.encode("utf-8")[:MAX_REASON_BYTES]
    return REFUSED + struct.pack(">H", len(reason)) + reason


async def read_message(reader: asyncio.StreamReader) -> Message:
    """The next message on ``reader``. Raises ``MalformedMessageError`` for an unknown type or
    an out-of-range length, ``asyncio.IncompleteReadError`` when the stream ends first."""
    kind = await reader.readexactly(1)
    if kind == OPEN:
        (size,) = struct.unpack(">H", await reader.readexactly(2))
        if not 0 < size <= MAX_TOKEN_BYTES:
            raise MalformedMessageError(f"relay: a token of {size} bytes (1-{MAX_TOKEN_BYTES})")
        return Open(await reader.readexactly(size))
    if kind == GRANTED:
        (port,) = struct.unpack(">H", await reader.readexactly(2))
        if port == 0:
            raise MalformedMessageError("relay: granted port 0")
        return Granted(port)
    if kind in (INCOMING, TAKE):
        (conn_id,) = struct.unpack(">Q", await reader.readexactly(8))
        return Incoming(conn_id) if kind == INCOMING else Take(conn_id)
    if kind == PING:
        return Ping()
    if kind == REFUSED:
        (size,) = struct.unpack(">H", await reader.readexactly(2))
        if size > MAX_REASON_BYTES:
            raise MalformedMessageError(f"relay: a reason of {size} bytes (at most {MAX_REASON_BYTES})")
        return Refused((await reader.readexactly(size)).decode("utf-8", errors="replace"))
    raise MalformedMessageError(f"relay: unknown message type {kind!r}")


async def ping_every(writer: asyncio.StreamWriter, seconds: float) -> None:
    """Keep a control connection alive: a ``Ping`` every ``seconds`` until cancelled."""
    while True:
        await asyncio.sleep(seconds)
        writer.write(encode(Ping()))
        await writer.drain()


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: list[int]) -> None:
    """Copy ``reader`` to ``writer`` until the end of the stream, adding the bytes to ``count[0]``;
    then half-close ``writer`` (the other direction may still be running)."""
    try:
        while chunk := await reader.read(1 << 16):
            count[0] += len(chunk)
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def pipe_both(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    counts: tuple[list[int], list[int]],
) -> None:
    """Splice two connections both ways until both directions end; close both.
    ``counts``: bytes a→b, bytes b→a."""
    try:
        await asyncio.gather(splice(a[0], b[1], counts[0]), splice(b[0], a[1], counts[1]))
    finally:
        for _, writer in (a, b):
            writer.close()
