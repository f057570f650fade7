"""The relay's wire: how a peer behind NAT gets a public port on a relay and takes the
connections that arrive there (``relay.server`` serves it, ``peer.net.relay_client`` uses it).

A peer that nobody can dial keeps one *control* connection open to the relay. It sends
``Open(token)`` (its access token: only admitted peers get a port); the relay answers
``Challenge(nonce)``, the peer ``Proof(signature)`` (``proof_bytes`` signed with the key the token
names: every admitted peer's token is in the run's open DHT, so a token alone proves nothing),
and the relay ``Granted(port)``: from then on ``relay-host:port`` is the peer's public address, which it
announces in the swarm. Each connection that arrives on that port is announced on the control
connection as ``Incoming(id, host, port)`` (where it comes from, as the relay sees it); the peer opens a new connection to the relay, sends
``Take(id)``, and the relay splices the two: the bytes of libp2p's own encrypted session pass
through unchanged. ``Ping`` keeps the control connection alive both ways; ``Refused(reason)``
ends it.

Hole punching (``peer.net.hole_punch``): a peer that reached another at its relay port asks for a
direct connection from a fresh socket: ``PunchAsk(token, port)``, proven as an ``Open`` is
(``Challenge``, ``Proof``). The relay tells the port's
holder, on its control connection, where the asker's socket came from: ``PunchCall(id, host,
port)``; the holder answers from a fresh socket of its own, ``PunchAnswer(id)``; the relay
sends each of the two the address the other's socket came from, ``PunchGo(host, port)``, and
both connect there from the same local ports at once (a TCP simultaneous open through two
NATs). Every message is a one-byte type and a fixed or length-prefixed body, read with a
bound, so a malformed one is a ``MalformedMessageError`` and never a large allocation.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable
from dataclasses import dataclass

from protocol.errors import MalformedMessageError
from protocol.messages import pae

MAX_TOKEN_BYTES = 4096
MAX_REASON_BYTES = 512
NONCE_BYTES = 32
MAX_PROOF_BYTES = 128
PROOF_TAG = b"swarmtrain.relay.proof.v1"

OPEN, GRANTED, INCOMING, TAKE, PING, REFUSED = b"O", b"G", b"I", b"T", b"P", b"R"
PUNCH_ASK, PUNCH_CALL, PUNCH_ANSWER, PUNCH_GO = b"H", b"C", b"A", b"N"
CHALLENGE, PROOF = b"Q", b"S"
OPENING, PUNCHING = "open", "punch"
"""What a ``Proof`` is for (signed into it: a proof for one is no proof for the other)."""
NOT_HELD = "nobody holds that port here"
"""A punch's refusal when the port asked for is no relayed peer's (e.g. another service on the
relay's host): the asker stops asking for it."""
MAX_HOST_BYTES = 45
"""An IPv4 or IPv6 address as text (the relay sends the addresses it observed, never names)."""


@dataclass(frozen=True)
class Open:
    token: bytes


@dataclass(frozen=True)
class Granted:
    port: int


@dataclass(frozen=True)
class Incoming:
    conn_id: int
    host: str
    port: int
    """Where the connection comes from, as the relay sees it."""


@dataclass(frozen=True)
class Take:
    conn_id: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class PunchAsk:
    token: bytes
    port: int
    """The relay port of the peer to punch through to."""


@dataclass(frozen=True)
class PunchCall:
    punch_id: int
    host: str
    port: int
    """Where the asker's socket came from, as the relay saw it."""


@dataclass(frozen=True)
class PunchAnswer:
    punch_id: int


@dataclass(frozen=True)
class PunchGo:
    host: str
    port: int
    """Where the other side's socket came from: connect there now."""


@dataclass(frozen=True)
class Challenge:
    nonce: bytes
    """``NONCE_BYTES`` random bytes, fresh for each ``Open`` or ``PunchAsk``."""


@dataclass(frozen=True)
class Proof:
    signature: bytes
    """The token's key's signature over ``proof_bytes`` for the challenge's nonce."""


Message = (
    Open | Granted | Incoming | Take | Ping | Refused | PunchAsk | PunchCall | PunchAnswer | PunchGo | Challenge | Proof
)


def proof_bytes(purpose: str, nonce: bytes, token: bytes) -> bytes:
    """What the holder of ``token`` signs to prove it, for ``purpose`` (``OPENING``,
    ``PUNCHING``) and a relay's ``nonce``."""
    return pae(PROOF_TAG, purpose.encode("ascii"), nonce, token)


def prove(challenge: Challenge, purpose: str, token: bytes, sign: Callable[[bytes], bytes]) -> Proof:
    """The ``Proof`` answering ``challenge`` for ``token``, signed by ``sign`` (its key's)."""
    return Proof(sign(proof_bytes(purpose, challenge.nonce, token)))


def _address(host: str, port: int) -> bytes:
    raw = host.encode("ascii")
    if not 0 < len(raw) <= MAX_HOST_BYTES or not 0 < port < 65536:
        raise ValueError(f"not an address to punch to: {host!r}:{port}")
    return struct.pack(">B", len(raw)) + raw + struct.pack(">H", port)


async def _read_address(reader: asyncio.StreamReader) -> tuple[str, int]:
    (size,) = struct.unpack(">B", await reader.readexactly(1))
    if not 0 < size <= MAX_HOST_BYTES:
        raise MalformedMessageError(f"relay: a host of {size} bytes (1-{MAX_HOST_BYTES})")
    raw = await reader.readexactly(size)
    (port,) = struct.unpack(">H", await reader.readexactly(2))
    try:
        host = str(ipaddress.ip_address(raw.decode("ascii")))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessageError(f"relay: {raw[:MAX_HOST_BYTES]!r} is not an IP address") from exc
    if port == 0:
        raise MalformedMessageError("relay: an address with port 0")
    return host, port


def encode(message: Message) -> bytes:
    """The bytes of ``message`` on the wire."""
    if isinstance(message, Open):
        if not 0 < len(message.token) <= MAX_TOKEN_BYTES:
            raise ValueError(f"a token is 1-{MAX_TOKEN_BYTES} bytes, got {len(message.token)}")
        return OPEN + struct.pack(">H", len(message.token)) + message.token
    if isinstance(message, Granted):
        return GRANTED + struct.pack(">H", message.port)
    if isinstance(message, Incoming):
        return INCOMING + struct.pack(">Q", message.conn_id) + _address(message.host, message.port)
    if isinstance(message, Take):
        return TAKE + struct.pack(">Q", message.conn_id)
    if isinstance(message, Ping):
        return PING
    if isinstance(message, PunchAsk):
        if not 0 < len(message.token) <= MAX_TOKEN_BYTES or not 0 < message.port < 65536:
            raise ValueError("a punch asks with a token of 1-4096 bytes for a port 1-65535")
        return PUNCH_ASK + struct.pack(">H", len(message.token)) + message.token + struct.pack(">H", message.port)
    if isinstance(message, PunchCall):
        return PUNCH_CALL + struct.pack(">Q", message.punch_id) + _address(message.host, message.port)
    if isinstance(message, PunchAnswer):
        return PUNCH_ANSWER + struct.pack(">Q", message.punch_id)
    if isinstance(message, PunchGo):
        return PUNCH_GO + _address(message.host, message.port)
    if isinstance(message, Challenge):
        if len(message.nonce) != NONCE_BYTES:
            raise ValueError(f"a challenge is {NONCE_BYTES} bytes, got {len(message.nonce)}")
        return CHALLENGE + message.nonce
    if isinstance(message, Proof):
        if not 0 < len(message.signature) <= MAX_PROOF_BYTES:
            raise ValueError(f"a proof is 1-{MAX_PROOF_BYTES} bytes, got {len(message.signature)}")
        return PROOF + struct.pack(">B", len(message.signature)) + message.signature
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
    if kind == INCOMING:
        (conn_id,) = struct.unpack(">Q", await reader.readexactly(8))
        return Incoming(conn_id, *await _read_address(reader))
    if kind == TAKE:
        (conn_id,) = struct.unpack(">Q", await reader.readexactly(8))
        return Take(conn_id)
    if kind == PING:
        return Ping()
    if kind == PUNCH_ASK:
        (size,) = struct.unpack(">H", await reader.readexactly(2))
        if not 0 < size <= MAX_TOKEN_BYTES:
            raise MalformedMessageError(f"relay: a token of {size} bytes (1-{MAX_TOKEN_BYTES})")
        token = await reader.readexactly(size)
        (port,) = struct.unpack(">H", await reader.readexactly(2))
        if port == 0:
            raise MalformedMessageError("relay: a punch to port 0")
        return PunchAsk(token, port)
    if kind == PUNCH_CALL:
        (punch_id,) = struct.unpack(">Q", await reader.readexactly(8))
        return PunchCall(punch_id, *await _read_address(reader))
    if kind == PUNCH_ANSWER:
        (punch_id,) = struct.unpack(">Q", await reader.readexactly(8))
        return PunchAnswer(punch_id)
    if kind == PUNCH_GO:
        return PunchGo(*await _read_address(reader))
    if kind == CHALLENGE:
        return Challenge(await reader.readexactly(NONCE_BYTES))
    if kind == PROOF:
        (size,) = struct.unpack(">B", await reader.readexactly(1))
        if not 0 < size <= MAX_PROOF_BYTES:
            raise MalformedMessageError(f"relay: a proof of {size} bytes (1-{MAX_PROOF_BYTES})")
        return Proof(await reader.readexactly(size))
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
