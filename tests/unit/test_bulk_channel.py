"""The bulk channel's pure parts: tickets, reading a reducer's ticket, direct addresses, frames."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from engine.bulk_channel import parse_ticket
from engine.bulk_client import direct_hosts
from engine.bulk_frames import MAX_FRAME_BYTES, FrameError, Kind, read_count, read_frame
from engine.bulk_server import TOKEN_BYTES, Tickets
from engine.bulk_settings import BulkSettings

PEER = PeerID.from_base58("QmaSgkhVQWGjMrR7vN5Gnb5bxZsk6mBavwsbRG1hWsP7Pu")


def test_a_token_works_once_for_the_peer_it_was_issued_to() -> None:
    tickets = Tickets()
    token = tickets.issue(PEER)
    assert len(token) == TOKEN_BYTES
    assert tickets.redeem(token) == PEER
    assert tickets.redeem(token) is None  # a replay
    assert tickets.redeem(b"\0" * TOKEN_BYTES) is None  # a guess


def test_an_expired_token_is_refused() -> None:
    tickets = Tickets(ttl_s=-1.0)
    assert tickets.redeem(tickets.issue(PEER)) is None


def test_a_peer_asking_for_tickets_in_a_loop_grows_nothing() -> None:
    tickets = Tickets(most=8)
    first = tickets.issue(PEER)
    for _ in range(100):
        tickets.issue(PEER)
    assert len(tickets) == 8
    assert tickets.redeem(first) is None  # the oldest went first


def test_a_member_asking_for_tickets_in_a_loop_never_drops_another_members() -> None:
    """Past ``PER_PEER_TICKETS`` a member's own oldest goes: another member's ticket, issued
    before the loop, still works (before the bound per peer the loop evicted it)."""
    other = PeerID.from_base58("QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC")
    tickets = Tickets(most=16, per_peer=4)
    kept = tickets.issue(other)
    mine = [tickets.issue(PEER) for _ in range(100)]
    assert len(tickets) == 5
    assert tickets.redeem(kept) == other
    assert [tickets.redeem(token) for token in mine[-5:]] == [None, PEER, PEER, PEER, PEER]


def _answer(payload: object, code: int = averaging_pb2.NO_CODE) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(code=code, peer_id=MSGPackSerializer.dumps(payload))


def test_a_ticket_is_read_only_when_it_is_well_formed() -> None:
    good = parse_ticket(_answer([4242, b"p" * 32, b"t" * 32]), MSGPackSerializer)
    assert good is not None and (good.port, good.pin, good.token) == (4242, b"p" * 32, b"t" * 32)
    for bad in (
        [70000, b"p" * 32, b"t" * 32],  # no such port
        [-1, b"p" * 32, b"t" * 32],
        ["4242", b"p" * 32, b"t" * 32],
        [4242, b"p" * 31, b"t" * 32],  # a pin that is no SHA-256
        [4242, b"p" * 32, b"t" * 33],
        [4242, "p" * 32, b"t" * 32],
        [4242, b"p" * 32],
        {"port": 4242},
    ):
        assert parse_ticket(_answer(bad), MSGPackSerializer) is None, bad
    assert parse_ticket(averaging_pb2.AveragingData(peer_id=b"\xc1\xff garbage"), MSGPackSerializer) is None
    assert parse_ticket(averaging_pb2.AveragingData(), MSGPackSerializer) is None  # no listener
    refused = _answer([4242, b"p" * 32, b"t" * 32], code=averaging_pb2.PROTOCOL_VIOLATION)
    assert parse_ticket(refused, MSGPackSerializer) is None


def test_only_direct_addresses_are_dialled() -> None:
    addrs = [
        "/ip4/10.0.0.2/tcp/31337",
        "/ip4/10.0.0.2/tcp/31338",  # the same host twice: dialled once
        "/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit",  # relayed: no direct path
        "/ip6/::1/tcp/4001",
        "/ip4/10.0.0.3/udp/4001/quic",
        "/dns4/example.org/tcp/4001",
    ]
    assert direct_hosts(addrs) == ["10.0.0.2", "::1"]


def test_bulk_settings_refuse_a_port_out_of_range() -> None:
    with pytest.raises(ValueError, match="bulk port"):
        BulkSettings(port=65536)
    with pytest.raises(ValueError, match="forwards to"):
        BulkSettings(public_port=4000)


def test_bulk_settings_read_from_a_flag() -> None:
    assert not BulkSettings.parse("off").enabled
    listen = BulkSettings.parse("7001", host="10.0.0.2")
    assert (listen.enabled, listen.host, listen.port, listen.public_port) == (True, "10.0.0.2", 7001, 0)
    mapped = BulkSettings.parse("7001:40123")
    assert (mapped.port, mapped.public_port) == (7001, 40123)
    for bad in ("", "x", "7001:", "70000", "7001:70000", "-1", "1:2:3"):
        with pytest.raises(ValueError):
            BulkSettings.parse(bad)


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_frame_over_the_limit_or_of_an_unknown_kind_is_refused_before_its_bytes_are_read() -> None:
    async def main() -> None:
        call = (7).to_bytes(4, "big")
        huge = bytes([Kind.DATA]) + call + (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
        with pytest.raises(FrameError, match="at most"):
            await read_frame(_reader(huge))
        with pytest.raises(FrameError, match="unknown kind"):
            await read_frame(_reader(bytes([9]) + call + bytes(4)))
        with pytest.raises(asyncio.IncompleteReadError):  # cut short
            await read_frame(_reader(bytes([Kind.DATA]) + call + bytes([0, 0, 0, 5]) + b"abc"))
        assert await read_frame(_reader(bytes([Kind.END]) + call + bytes(4))) == (Kind.END, 7, b"")
        with pytest.raises(FrameError, match="positive count"):  # a credit of nothing, or garbled
            read_count(bytes(4))
        with pytest.raises(FrameError, match="positive count"):
            read_count(b"\x01")
        assert read_count((3).to_bytes(4, "big")) == 3

    asyncio.run(main())


def test_the_peers_bulk_port_flag_is_checked_before_anything_starts() -> None:
    import argparse

    from peer.cli import add_parser, check_args
    from protocol.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for good in ("0", "7001", "7001:40123", "off"):
        check_args(parser.parse_args(["peer", "--spec", "run.toml", "--bulk-port", good]))
    for bad in ("seven", "70000", "0:4000"):
        with pytest.raises(ConfigError, match="--bulk-port"):
            check_args(parser.parse_args(["peer", "--spec", "run.toml", "--bulk-port", bad]))
