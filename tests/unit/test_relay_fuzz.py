"""Fuzzing of the relay wire (``relay.wire``), the control and punch messages both ends
read from a stranger: 10,000 inputs into the parser (random bytes behind each message type,
and valid encodings cut short, bit-flipped, with their length fields changed), and 400 more
streams into a live relay's control port. No input crashes the parser, hangs it (a bounded read
of what it was given) or is read as more than it holds; the relay ends up as it began (no
port held, no punch, no connection waiting) and still grants an admitted peer its port.
Seeded (``SEED``): a failure reproduces."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator

import pytest

from peer.net.relay_client import RelayAddress, RelayTunnel
from protocol.errors import MalformedMessageError
from relay.server import Relay
from relay.wire import (
    CHALLENGE,
    GRANTED,
    INCOMING,
    OPEN,
    PING,
    PROOF,
    PUNCH_ANSWER,
    PUNCH_ASK,
    PUNCH_CALL,
    PUNCH_GO,
    REFUSED,
    TAKE,
    Challenge,
    Granted,
    Incoming,
    Message,
    Open,
    Ping,
    Proof,
    PunchAnswer,
    PunchAsk,
    PunchCall,
    PunchGo,
    Refused,
    Take,
    encode,
    read_message,
)
from swarmtrain.localswarm import wait_until
from tests.ports import free_ports
from tests.unit.relay_keys import signer, stand_in_relay

SEED = 20261127
PARSER_INPUTS = 10_000
LIVE_STREAMS = 400
TYPES = [OPEN, GRANTED, INCOMING, TAKE, PING, REFUSED, PUNCH_ASK, PUNCH_CALL, PUNCH_ANSWER, PUNCH_GO, CHALLENGE, PROOF]
VALID: list[Message] = [
    Open(b"ok-token"),
    Granted(7801),
    Incoming(2**63, "203.0.113.9", 4100),
    Incoming(7, "2001:db8::1", 65535),
    Take(12345),
    Ping(),
    Refused("nobody holds that port here: 7802"),
    PunchAsk(b"ok-token", 7802),
    PunchCall(99, "198.51.100.4", 50000),
    PunchAnswer(99),
    PunchGo("198.51.100.4", 50001),
    Challenge(bytes(range(32))),
    Proof(bytes(64)),
]


def _mutated(rng: random.Random) -> bytes:
    """One fuzz input: random bytes behind a message type, or a valid message damaged."""
    if rng.random() < 0.4:
        return rng.choice(TYPES) + rng.randbytes(rng.randrange(0, 80))
    data = bytearray(encode(rng.choice(VALID)))
    damage = rng.randrange(4)
    if damage == 0:  # cut short
        return bytes(data[: rng.randrange(len(data))])
    if damage == 1:  # bits flipped
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if damage == 2 and len(data) > 2:  # a length field (or any 2 bytes after the type) changed
        at = rng.randrange(1, len(data) - 1)
        data[at : at + 2] = rng.randbytes(2)
        return bytes(data)
    return bytes(data) + rng.randbytes(rng.randrange(1, 16))  # trailing garbage


async def _parse(data: bytes) -> tuple[Message | None, int]:
    """What ``read_message`` makes of ``data`` (None: refused), and the bytes it left unread."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        message = await asyncio.wait_for(read_message(reader), 1.0)
    except (MalformedMessageError, asyncio.IncompleteReadError):
        return None, -1
    left = len(await reader.read())
    return message, left


def test_ten_thousand_inputs_into_the_parser_crash_nothing_and_read_no_more_than_given() -> None:
    rng = random.Random(SEED)

    async def run() -> tuple[int, int]:
        parsed = refused = 0
        for _ in range(PARSER_INPUTS):
            data = _mutated(rng)
            message, left = await _parse(data)  # anything else raised fails the test
            if message is None:
                refused += 1
                continue
            parsed += 1
            assert 0 <= left < len(data)
            again = encode(message)  # whatever was read is a well-formed message
            assert await _parse(again) == (message, 0)
        return parsed, refused

    parsed, refused = asyncio.run(run())
    assert parsed + refused == PARSER_INPUTS and parsed > 0 and refused > 0


@pytest.fixture
def relay() -> Iterator[Relay]:
    with stand_in_relay(free_ports(1)) as served:
        yield served


def test_fuzzed_streams_into_a_live_relay_change_nothing(relay: Relay) -> None:
    """400 streams of 1-4 fuzz inputs each, from 40 source addresses (the relay caps idle
    connections per source): the relay holds no port and no punch afterwards, no connection
    waits for its first message, and an admitted peer then gets its port."""
    rng = random.Random(SEED + 1)
    for n in range(LIVE_STREAMS):
        data = b"".join(_mutated(rng) for _ in range(rng.randrange(1, 5)))
        source = f"127.0.0.{2 + n % 40}"
        with socket.create_connection(("127.0.0.1", relay.control_port), timeout=5, source_address=(source, 0)) as conn:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)  # the end of the stream: nothing more will come
            conn.settimeout(5)
            try:
                while conn.recv(1 << 16):
                    pass
            except (TimeoutError, ConnectionError):
                pass
    wait_until(lambda: relay._unopened_total == 0, 15, "every fuzzed connection to end")
    assert relay.stats().peers == 0 and relay.punches == 0 and relay._punches == {}
    tunnel = RelayTunnel(
        RelayAddress("127.0.0.1", relay.control_port), token=lambda: b"ok-after", sign=signer(b"ok-after"), local_port=1
    )
    try:
        assert tunnel.open() > 0
    finally:
        tunnel.close()
