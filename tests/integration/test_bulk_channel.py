"""The bulk channel (``engine.bulk_channel``) under attack, over real sockets and real TLS: an
outsider at the reducer's port, a replayed token, a man in the middle with another certificate,
bytes flipped on the path, a stranger asking a gated run's averager for a ticket; and the
fallback to libp2p where a reducer has no listener."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
from hivemind import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

import engine.bulk_link
import engine.bulk_server
from engine.averager import ExactAverager
from engine.bulk_channel import parse_ticket
from engine.bulk_client import BulkPool, Ticket
from engine.bulk_frames import WINDOW, Kind, read_frame, write_frame
from engine.bulk_server import TOKEN_BYTES, BulkServer, Tickets
from engine.bulk_settings import BulkSettings
from engine.bulk_tls import ServerCert, client_context, make_server_cert
from engine.codecs import get_codec
from engine.outcome import GroupOutcome
from protocol.identity import Identity
from protocol.membership import MemberGate
from tests.integration.bulk_parts import Echo, part, run
from tests.integration.bulk_parts import call as call_over

LOCAL = PeerID.from_base58("QmaSgkhVQWGjMrR7vN5Gnb5bxZsk6mBavwsbRG1hWsP7Pu")
MEMBER = PeerID.from_base58("QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def listening(handler: Echo) -> tuple[BulkServer, ServerCert, Tickets]:
    cert, tickets = make_server_cert(), Tickets()
    server = BulkServer(BulkPool(_no_ticket, _loopback, handler=handler, local_id=LOCAL), cert.context, tickets)
    await server.start("127.0.0.1", 0)
    return server, cert, tickets


def pool_to(port: int, pin: bytes, tickets: Tickets, peer: PeerID = MEMBER) -> BulkPool:
    """A sender's pool whose tickets come straight from ``tickets`` (as ``rpc_bulk_ticket`` would)."""

    async def ticket(_reducer: PeerID) -> Ticket:
        return Ticket(port, pin, tickets.issue(peer))

    return BulkPool(ticket, _loopback, dial_s=3.0)


async def _no_ticket(_peer: PeerID) -> Ticket | None:
    return None


async def _loopback(_reducer: PeerID) -> list[str]:
    """A reducer's direct addresses, as the libp2p connection would give them: loopback."""
    return ["127.0.0.1"]


async def call(pool: BulkPool, payloads: list[bytes]) -> list[bytes]:
    link = await pool.open(LOCAL)
    assert link is not None
    return await call_over(link, payloads)


def test_a_member_with_a_ticket_averages_over_one_kept_connection() -> None:
    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        pool = pool_to(server.port, cert.pin, tickets)
        try:
            for round_ in range(3):
                payloads = [bytes([round_, i]) * 50_000 for i in range(5)]
                assert await call(pool, payloads) == payloads
            assert pool.dials == 1  # the next rounds took the kept connection
            assert echo.calls == [MEMBER] * 3  # under the identity its ticket named
            assert server.refused == 0
        finally:
            pool.close()
            await server.stop()

    run(main)


async def _refused(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection without a word (no ``HELLO``)."""
    try:
        await asyncio.wait_for(read_frame(reader), 10)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        return True
    return False


def test_an_outsider_at_the_port_is_refused_without_a_valid_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.bulk_server, "HELLO_TIMEOUT_S", 1.0)

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        try:
            # not TLS at all
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(1000))
            await writer.drain()
            assert await reader.read() == b""
            writer.close()

            async def tls() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                return await asyncio.open_connection("127.0.0.1", server.port, ssl=client_context(), server_hostname="")

            # a guessed token
            reader, writer = await tls()
            write_frame(writer, Kind.HELLO, bytes(TOKEN_BYTES))
            await writer.drain()
            assert await _refused(reader)
            writer.close()
            # a part before any token
            reader, writer = await tls()
            write_frame(writer, Kind.DATA, part(b"x" * 100).SerializeToString())
            await writer.drain()
            assert await _refused(reader)
            writer.close()
            # silence: dropped after the hello deadline
            reader, writer = await tls()
            assert await _refused(reader)
            writer.close()
            # a real token, then the same token again (overheard, or replayed by its holder)
            token = tickets.issue(MEMBER)
            reader, writer = await tls()
            write_frame(writer, Kind.HELLO, token)
            await writer.drain()
            assert await read_frame(reader) == (Kind.HELLO, 0, b"")
            replay_reader, replay_writer = await tls()
            write_frame(replay_writer, Kind.HELLO, token)
            await replay_writer.drain()
            assert await _refused(replay_reader)
            replay_writer.close()
            # the admitted connection announces a frame of 2 GiB: dropped before reading it
            writer.write(bytes([Kind.DATA]) + (1).to_bytes(4, "big") + (2**31).to_bytes(4, "big"))
            await writer.drain()
            assert await _refused(reader)
            writer.close()
            assert echo.calls == [] and echo.parts == []  # nothing reached the averager
            assert server.refused == 5  # the plain-text one, the guess, the early part, the silence, the replay
        finally:
            await server.stop()

    run(main)


def test_a_sender_talks_only_to_the_certificate_its_ticket_pins() -> None:
    """A man in the middle at the reducer's address, with a certificate of its own: the sender
    refuses it before it sends the token or a part, and its parts go over libp2p instead."""

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        impostor = make_server_cert()
        heard: list[bytes] = []

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heard.append(await reader.read())
            writer.close()

        fake = await asyncio.start_server(record, "127.0.0.1", 0, ssl=impostor.context)
        fake_port = fake.sockets[0].getsockname()[1]
        pool = pool_to(fake_port, cert.pin, tickets)  # the real reducer's pin, the impostor's port
        try:
            assert await pool.open(LOCAL) is None
            assert await pool.open(LOCAL) is None  # and it is not tried again at once
            assert pool.dials == 0
            for _ in range(100):
                if heard:
                    break
                await asyncio.sleep(0.05)
            assert heard == [b""]  # the impostor got the handshake and nothing else: no token
        finally:
            fake.close()
            await server.stop()

    run(main)


class FlippingProxy:
    """A TCP relay between sender and reducer that flips one bit of the sender's bytes at
    ``offset`` (a hostile relay or router on the path)."""

    def __init__(self, target_port: int, offset: int) -> None:
        self.target_port, self.offset = target_port, offset
        self.flipped = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, tamper: bool) -> None:
            seen = 0
            try:
                while data := await source.read(65536):
                    if tamper and seen <= self.offset < seen + len(data):
                        at = self.offset - seen
                        data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
                        self.flipped = True
                    seen += len(data)
                    sink.write(data)
                    await sink.drain()
            finally:  # either end gone: the other goes too
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)


def test_a_part_altered_on_the_path_never_reaches_the_average() -> None:
    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        proxy = FlippingProxy(server.port, offset=200_000)  # well past the handshake, inside a part
        pool = pool_to(await proxy.start(), cert.pin, tickets)
        payloads = [bytes([i]) * 100_000 for i in range(6)]
        try:
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, ssl.SSLError)):
                await call(pool, payloads)
            assert proxy.flipped
            assert all(got in payloads for got in echo.parts)  # what arrived is what was sent
            assert len(echo.parts) < len(payloads)  # and the altered part is not among it
        finally:
            pool.close()
            proxy.server.close()
            await server.stop()

    run(main)


def _averagers(settings: list[BulkSettings], gate: MemberGate | None = None) -> tuple[list[DHT], list[ExactAverager]]:
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [
        DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in settings[1:]
    ]
    averagers = []
    for i, (dht, bulk) in enumerate(zip(dhts, settings)):
        averager = ExactAverager(
            4000,
            dht,
            codec=get_codec("none"),
            prefix="bulk",
            start=True,
            min_group_size=len(settings),
            target_group_size=len(settings),
            min_matchmaking_time=3.0,
            request_timeout=3.0,
            allreduce_timeout=15.0,
            gate=gate,
            bulk=bulk,
        )
        with averager.get_tensors() as tensors:
            tensors[0].fill_(float(i + 1))
        averagers.append(averager)
    return dhts, averagers


def test_a_reducer_without_a_listener_gets_its_parts_over_libp2p() -> None:
    dhts, averagers = _averagers([BulkSettings(), BulkSettings(enabled=False)])
    outcomes: dict[int, GroupOutcome] = {}
    try:

        def step(i: int) -> None:
            outcomes[i] = averagers[i].step(weight=1.0, timeout=30, allow_retries=False)

        threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert set(outcomes) == {0, 1}
        for i, averager in enumerate(averagers):
            assert not outcomes[i].failed and not outcomes[i].stats.missing, outcomes[i]
            assert outcomes[i].stats.over_bulk == []  # one has no listener, the other does not dial
            with averager.get_tensors() as tensors:
                assert torch.equal(tensors[0], torch.full((4000,), 1.5))
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


async def _ask_for_a_ticket(_dht: Any, node: Any, *, reducer: PeerID) -> bytes:
    """In a DHT node's process: its ``rpc_bulk_ticket`` call to ``reducer``, as sent back."""
    stub = ExactAverager.get_stub(node.p2p, reducer, namespace="bulk")
    answer = await stub.rpc_bulk_ticket(averaging_pb2.AveragingData(), timeout=10)
    return bytes(answer.SerializeToString())


@contextlib.contextmanager
def _stranger_beside(gate: MemberGate | None = None) -> Iterator[tuple[ExactAverager, averaging_pb2.AveragingData]]:
    """One averager with a listener (gated by ``gate``), and a stranger's ``rpc_bulk_ticket``
    answer from it; everything shut down after."""
    dhts, averagers = _averagers([BulkSettings()], gate=gate)
    stranger = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=dhts[0].get_visible_maddrs())
    try:
        answer = averaging_pb2.AveragingData.FromString(
            stranger.run_coroutine(partial(_ask_for_a_ticket, reducer=dhts[0].peer_id))
        )
        yield averagers[0], answer
    finally:
        stranger.shutdown()
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_stranger_gets_no_ticket_from_a_gated_run() -> None:
    gate = MemberGate(coordinator_key=Identity.generate().public_key, run_digest="bulk", prefix="bulk")
    with _stranger_beside(gate) as (averager, answer):
        assert answer.code == averaging_pb2.PROTOCOL_VIOLATION
        assert parse_ticket(answer, averager.serializer) is None


def test_a_slow_dial_lets_this_call_use_libp2p_and_serves_the_next() -> None:
    """A ticket slower than the call can wait (a first dial on a saturated link): the call gets
    no connection and uses libp2p, and the dial, never cancelled, serves the next round."""

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)

        async def slow_ticket(_reducer: PeerID) -> Ticket:
            await asyncio.sleep(1.0)
            return Ticket(server.port, cert.pin, tickets.issue(MEMBER))

        pool = BulkPool(slow_ticket, _loopback, quick_s=0.2)
        try:
            assert await pool.open(LOCAL) is None  # this round: libp2p
            for _ in range(200):  # the dial goes on, and its connection is kept
                if pool.kept(LOCAL):
                    break
                await asyncio.sleep(0.05)
            assert pool.dials == 1 and pool.kept(LOCAL) == 1
            assert await call(pool, [b"next round"]) == [b"next round"]  # the kept connection
            assert pool.dials == 1
        finally:
            pool.close()
            await server.stop()

    run(main)


def test_a_ticket_whose_libp2p_call_failed_is_asked_for_again_at_the_next_call() -> None:
    """A first round's ticket call can fail in libp2p itself (its dial backoff refused a dial to
    a peer not yet connected): that says nothing about a direct path, so the next round asks
    again and gets the channel, where a reducer without a listener is left to libp2p."""

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        asked: list[int] = []

        async def flaky_ticket(_reducer: PeerID) -> Ticket:
            asked.append(1)
            if len(asked) == 1:
                raise ConnectionError("failed to dial: all dials failed (dial backoff)")
            return Ticket(server.port, cert.pin, tickets.issue(MEMBER))

        pool = BulkPool(flaky_ticket, _loopback, dial_s=3.0)
        try:
            assert await pool.open(LOCAL) is None  # this round: libp2p
            assert await call(pool, [b"next round"]) == [b"next round"]  # asked again, and dialled
            assert len(asked) == 2 and pool.dials == 1
        finally:
            pool.close()
            await server.stop()

    run(main)


def test_a_member_with_a_ticket_cannot_average_in_a_group_it_is_not_in() -> None:
    """An open run: anyone may take a ticket (as anyone may open a libp2p stream), and what it
    sends then meets the averager's own handler: parts for a group this reducer does not run
    get ``BAD_GROUP_ID`` and nothing else."""
    with _stranger_beside() as (averager, answer):
        ticket = parse_ticket(answer, averager.serializer)
        assert ticket is not None

        async def main() -> list[averaging_pb2.AveragingData]:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", ticket.port, ssl=client_context(), server_hostname=""
            )
            write_frame(writer, Kind.HELLO, ticket.token)
            write_frame(writer, Kind.DATA, part(b"\0" * 1000).SerializeToString(), call=1)  # group b"g": none here
            write_frame(writer, Kind.END, call=1)
            await writer.drain()
            assert await read_frame(reader) == (Kind.HELLO, 0, b"")
            answers = []
            while (frame := await asyncio.wait_for(read_frame(reader), 30))[0] != Kind.END:
                if frame[0] == Kind.DATA:
                    answers.append(averaging_pb2.AveragingData.FromString(frame[2]))
            writer.close()
            return answers

        answers = asyncio.run(main())
        assert [a.code for a in answers] == [averaging_pb2.BAD_GROUP_ID]


class SlowEcho(Echo):
    """Answers each part after ``delay_s`` (a reducer waiting for the other senders)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def __call__(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().__call__(stream, context):
            await asyncio.sleep(self.delay_s)
            yield message


def test_an_answer_to_a_call_given_up_is_never_taken_for_the_next_calls() -> None:
    """A sender that gave up waiting for an averaged part (its deadline) closes that call; the
    reducer's late answer to it, arriving on the same kept connection, must not pass for an
    answer to the next round's call: calls are numbered, a number is never used twice, and what
    comes for a closed call is dropped."""

    async def main() -> None:
        server, cert, tickets = await listening(SlowEcho(delay_s=1.0))
        pool = pool_to(server.port, cert.pin, tickets)
        try:
            connection = await pool.open(LOCAL)
            assert connection is not None

            async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
                yield part(b"late" * 100_000)  # and the request stream ends: the call could end cleanly

            answers = connection.call(requests())
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(anext(answers), 0.2)
            await answers.aclose()
            assert await call(pool, [b"next round"]) == [b"next round"]  # not b"late...", which came first
            assert pool.dials == 1 and await pool.open(LOCAL) is connection
        finally:
            pool.close()
            await server.stop()

    run(main)


class Gated(Echo):
    """Answers the first part of every call at once; the rest of a call named ``b"hold"`` only
    once ``release`` is set (a reducer waiting for the other senders of one fragment)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def __call__(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().__call__(stream, context):
            yield message
            if message.tensor_part.buffer.startswith(b"hold"):
                await self.release.wait()


def test_a_fragment_held_up_at_the_reducer_never_holds_up_another_on_the_same_connection() -> None:
    """Every fragment's call to a reducer shares one connection. One call's reducer stops
    reading (waiting for other senders) while its sender has many more megabytes of parts to
    send: another call on the same connection still finishes (credits: a reader never waits on
    one call with another's frames behind it), and the held call finishes once released."""

    async def main() -> None:
        handler = Gated()
        server, cert, tickets = await listening(handler)
        pool = pool_to(server.port, cert.pin, tickets)
        try:
            held = [b"hold" + bytes([i]) * 1_000_000 for i in range(24)]  # 24 MB behind the first
            held_call = asyncio.create_task(call(pool, held))
            await asyncio.sleep(0.5)  # its parts fill every buffer they may
            free = [bytes([i]) * 500_000 for i in range(6)]
            assert await asyncio.wait_for(call(pool, free), 20) == free
            assert not held_call.done()
            handler.release.set()
            assert await asyncio.wait_for(held_call, 30) == held
            assert pool.dials == 1  # both calls, one connection
        finally:
            pool.close()
            await server.stop()

    run(main)


def test_the_fragments_of_a_round_share_one_connection_and_its_dial() -> None:
    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        pool = pool_to(server.port, cert.pin, tickets)
        try:
            for round_ in range(2):
                payloads = [[bytes([round_, f, i]) * 30_000 for i in range(10)] for f in range(4)]
                got = await asyncio.gather(*(call(pool, p) for p in payloads))
                assert got == payloads
            assert pool.dials == 1 and echo.calls == [MEMBER] * 8
        finally:
            pool.close()
            await server.stop()

    run(main)


def test_a_call_opened_first_may_send_its_first_part_last() -> None:
    """Fragments' calls start at once, and the one made first may have its first part ready
    last: the reducer must take it as a new call, not as one that ended (which it would drop)."""

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        pool = pool_to(server.port, cert.pin, tickets)
        try:
            connection = await pool.open(LOCAL)
            assert connection is not None
            ready = asyncio.Event()

            async def late() -> AsyncIterator[averaging_pb2.AveragingData]:
                await ready.wait()
                yield part(b"first made")
                await asyncio.Event().wait()

            first = connection.call(late())
            assert await call(pool, [b"second made"]) == [b"second made"]
            ready.set()
            answer = await asyncio.wait_for(anext(first), 10)
            assert answer.tensor_part.buffer == b"first made"
            await first.aclose()
        finally:
            pool.close()
            await server.stop()

    run(main)


async def _admitted(server: BulkServer, tickets: Tickets) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=client_context(), server_hostname="")
    write_frame(writer, Kind.HELLO, tickets.issue(MEMBER))
    await writer.drain()
    assert await read_frame(reader) == (Kind.HELLO, 0, b"")
    return reader, writer


def test_a_member_that_sends_past_its_credit_or_opens_calls_without_end_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member (it holds a ticket) that floods a reducer: parts past a call's credit, to make the
    reducer hold them all unread, or more calls than a connection may have open. Either drops
    its connection, and the reducer never holds more than the window per call."""
    monkeypatch.setattr(engine.bulk_link, "MAX_CALLS", 4)

    async def main() -> None:
        handler = Gated()  # reads a call's first part, then waits
        server, cert, tickets = await listening(handler)
        try:
            reader, writer = await _admitted(server, tickets)
            for _ in range(WINDOW + 3):  # the window is WINDOW; the reducer credits the one it read
                write_frame(writer, Kind.DATA, part(b"hold" * 1000).SerializeToString(), call=1)
            await writer.drain()
            assert await _dropped(reader)
            writer.close()
            assert len(handler.parts) <= WINDOW

            reader, writer = await _admitted(server, tickets)
            for number in range(1, 6):  # a fifth call open at once
                write_frame(writer, Kind.DATA, part(b"hold").SerializeToString(), call=number)
            await writer.drain()
            assert await _dropped(reader)
            writer.close()

            reader, writer = await _admitted(server, tickets)
            write_frame(writer, Kind.END, call=1)  # a call that begins with its end
            await writer.drain()
            assert await _dropped(reader)
            writer.close()
        finally:
            handler.release.set()
            await server.stop()

    run(main)


async def _dropped(reader: asyncio.StreamReader) -> bool:
    """Whether the other end closed the connection (after whatever frames it sent first)."""
    try:
        async with asyncio.timeout(10):
            while True:
                await read_frame(reader)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_a_hostile_reducer_that_floods_or_answers_calls_never_made_breaks_only_its_own_connection() -> None:
    """A reducer (it listens, its ticket is genuine) that sends a sender more averaged parts than
    it was credited (to make it hold them all), answers a call the sender never opened, or sends
    frames of the wrong side: the sender's calls on that connection fail (the averaging treats
    the reducer as failed), the sender holds at most the window per call, and the next call
    dials anew."""

    async def main() -> None:
        cert, tickets = make_server_cert(), Tickets()
        attacks = [
            [(Kind.DATA, 1, part(b"x").SerializeToString())] * (WINDOW + 1),  # past the credit
            [(Kind.DATA, 9, part(b"x").SerializeToString())],  # a call never opened
            [(Kind.CLOSE, 1, b"")],  # a frame only a sender sends
            [(Kind.CREDIT, 1, bytes(4))],  # a credit of nothing
            [(Kind.END, 2, b"")],  # a call of its own (even: the acceptor's) begun by its end
            [(Kind.DATA, 3, part(b"x").SerializeToString())],  # an odd call: the dialler's, never made
        ]
        served: list[int] = []

        async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            _kind, _call, token = await read_frame(reader)
            assert tickets.redeem(token) == MEMBER
            write_frame(writer, Kind.HELLO)
            await read_frame(reader)  # the call's first part
            for kind, number, payload in attacks[len(served)]:
                write_frame(writer, kind, payload, call=number)
            served.append(1)
            await writer.drain()
            await reader.read()  # until the sender hangs up

        fake = await asyncio.start_server(hostile, "127.0.0.1", 0, ssl=cert.context)
        pool = pool_to(fake.sockets[0].getsockname()[1], cert.pin, tickets)
        try:
            for attack in range(len(attacks)):
                connection = await pool.open(LOCAL)
                assert connection is not None and pool.dials == attack + 1  # a broken one is not kept

                async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
                    yield part(b"mine")
                    await asyncio.Event().wait()  # as a sender waiting for its answers

                answers = connection.call(requests())
                async with asyncio.timeout(10):  # nobody reads the answers meanwhile: none is credited
                    while connection.broken is None:
                        await asyncio.sleep(0.02)
                with pytest.raises(ConnectionError):
                    for _ in range(WINDOW + 1):  # at most the credited parts, then the break
                        await asyncio.wait_for(anext(answers), 10)
                await answers.aclose()
                assert connection.broken is not None and not connection.alive()
        finally:
            pool.close()
            fake.close()

    run(main)


def test_an_outsider_holding_idle_connections_never_locks_a_member_out() -> None:
    """An outsider opens connections in a loop and says nothing in them (a TLS handshake, then
    silence; or not even that): from one address it holds ``PENDING_PER_HOST`` of them, the rest
    are closed at once, and a member's connection is served beside them. Before the limits
    before the token, 32 silent connections filled a listener of 32 and the member was refused."""

    async def main() -> None:
        echo = Echo()
        server, cert, tickets = await listening(echo)
        server.most, server.pending_most = 32, 16  # a small listener: what 4,096 slots are to a loop
        held: list[asyncio.StreamWriter] = []
        try:
            for n in range(server.most + 4):
                with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                    tls = n < server.most  # a TLS handshake, then silence; the last few not even that
                    _reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(
                            "127.0.0.1",
                            server.port,
                            ssl=client_context() if tls else None,
                            server_hostname="" if tls else None,
                            local_addr=("127.0.0.3", 0),
                        ),
                        5,
                    )
                    held.append(writer)
            await _poll(lambda: len(server._open) + server.refused >= server.most)  # each one held or refused
            pool = pool_to(server.port, cert.pin, tickets)
            try:
                payloads = [b"member" * 1000]
                assert await call(pool, payloads) == payloads
                assert echo.calls == [MEMBER]
            finally:
                pool.close()
        finally:
            for writer in held:
                writer.close()
            await server.stop()

    run(main)


def test_a_member_opening_connection_after_connection_keeps_two() -> None:
    """Each ticket it asks for opens one more: past ``PER_PEER`` its oldest is closed, so one
    admitted member cannot fill the listener (before: every one was kept)."""

    async def main() -> None:
        server, _cert, tickets = await listening(Echo())
        try:
            opened = [await _admitted(server, tickets) for _ in range(5)]
            for reader, _writer in opened[: -engine.bulk_server.PER_PEER]:
                assert await _refused(reader)
            assert len(server._open) == engine.bulk_server.PER_PEER
            for _reader, writer in opened:
                writer.close()
        finally:
            await server.stop()

    run(main)


async def _poll(done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not come in time"
        await asyncio.sleep(0.02)
