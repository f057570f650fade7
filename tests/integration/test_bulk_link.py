"""One bulk connection per pair of members (``engine.bulk_link``), over real sockets and real
TLS: two reducers trade parts both ways over the link one of them dialled; both dialling at once
ends with one link at both ends; a peer that was to dial and did not costs one wait; an
acceptor's calls run under the identity its ticket was asked of, and one that makes calls out
of turn breaks only its own link."""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from engine.bulk_client import BulkPool, Ticket
from engine.bulk_frames import Kind, read_frame, write_frame
from engine.bulk_link import BulkLink
from engine.bulk_server import BulkServer, Tickets
from engine.bulk_tls import make_server_cert
from tests.integration.bulk_parts import Echo, call, part, run

A, B = sorted(
    (
        PeerID.from_base58("QmaSgkhVQWGjMrR7vN5Gnb5bxZsk6mBavwsbRG1hWsP7Pu"),
        PeerID.from_base58("QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"),
    ),
    key=lambda peer: peer.to_bytes(),
)
"""``A`` sorts first: of a pair that both reduce, ``A`` dials."""


async def _loopback(_peer: PeerID) -> list[str]:
    return ["127.0.0.1"]


class Member:
    """A member's pool and listener, its tickets asked of the other members' listeners."""

    def __init__(self, me: PeerID, others: dict[PeerID, Member], quick_s: float = 2.0) -> None:
        self.me, self.echo = me, Echo()
        self.cert, self.tickets = make_server_cert(), Tickets()
        self.asked: list[PeerID] = []

        async def ticket(peer: PeerID) -> Ticket | None:
            self.asked.append(peer)
            other = others[peer]
            return Ticket(other.server.port, other.cert.pin, other.tickets.issue(me))

        self.pool = BulkPool(ticket, _loopback, handler=self.echo, local_id=me, dial_s=5.0, quick_s=quick_s)
        self.server = BulkServer(self.pool, self.cert.context, self.tickets)

    async def close(self) -> None:
        self.pool.close()
        await self.server.stop()


async def members(quick_s: float = 2.0) -> dict[PeerID, Member]:
    found: dict[PeerID, Member] = {}
    for peer in (A, B):
        found[peer] = Member(peer, found, quick_s)
        await found[peer].server.start("127.0.0.1", 0)
    return found


def _same_connection(one: BulkLink, other: BulkLink) -> bool:
    return bool(one.writer.get_extra_info("sockname") == other.writer.get_extra_info("peername"))


def test_two_reducers_trade_parts_both_ways_over_the_one_link_the_first_dialled() -> None:
    async def main() -> None:
        swarm = await members()
        a, b = swarm[A], swarm[B]
        try:
            for round_ in range(3):
                # B waits for A's link (A sorts first), A dials it: at once, as a round's opens are
                link_b, link_a = await asyncio.gather(b.pool.open(A, theirs=True), a.pool.open(B))
                assert link_a is not None and link_b is not None and _same_connection(link_a, link_b)
                assert link_a.dialled and not link_b.dialled
                payloads = [bytes([round_, i]) * 40_000 for i in range(6)]
                # four fragments each way at once, over the same connection
                got = await asyncio.gather(
                    *(call(link_a, payloads) for _ in range(4)), *(call(link_b, payloads) for _ in range(4))
                )
                assert got == [payloads] * 8
            assert a.pool.dials == 1 and b.pool.dials == 0 and b.asked == []  # one connection, from A
            assert a.echo.calls == [B] * 12 and b.echo.calls == [A] * 12  # each under the other's identity
            assert a.pool.links() == b.pool.links() == 1
        finally:
            for member in swarm.values():
                await member.close()

    run(main)


def test_both_ends_dialling_at_once_end_with_the_same_one_link() -> None:
    async def main() -> None:
        swarm = await members()
        a, b = swarm[A], swarm[B]
        try:
            link_a, link_b = await asyncio.gather(a.pool.open(B), b.pool.open(A))  # neither waits
            assert link_a is not None and link_b is not None
            assert a.pool.dials == 1 and b.pool.dials == 1

            async def settled() -> tuple[BulkLink, BulkLink]:
                while True:  # each end learns of the other's link once its listener took it
                    kept_a, kept_b = await a.pool.open(B), await b.pool.open(A)
                    if kept_a is not None and kept_b is not None and _same_connection(kept_a, kept_b):
                        return kept_a, kept_b
                    await asyncio.sleep(0.05)

            kept_a, kept_b = await asyncio.wait_for(settled(), 10)
            assert kept_a.dialled and not kept_b.dialled  # the one A dialled, at both ends
            payloads = [b"p" * 1000, b"q" * 1000]
            assert await call(kept_a, payloads) == payloads and await call(kept_b, payloads) == payloads
            # the other one carried nothing and is closed once idle, by both ends
            assert (a.pool.links(), b.pool.links()) == (2, 2)
        finally:
            for member in swarm.values():
                await member.close()

    run(main)


def test_a_peer_that_was_to_dial_and_did_not_costs_one_wait() -> None:
    """B waits for A's link; A never dials (it had nothing to send, or cannot reach B): B dials
    after ``quick_s``, and from then on the pair's link is kept, with no more waiting."""

    async def main() -> None:
        swarm = await members(quick_s=0.5)
        a, b = swarm[A], swarm[B]
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await b.pool.open(A, theirs=True) is None  # this call takes libp2p
            assert 0.4 < loop.time() - started < 2.0
            while b.pool.kept(A) == 0:  # B's own dial, in the background
                await asyncio.sleep(0.02)
            started = loop.time()
            link = await b.pool.open(A, theirs=True)
            assert link is not None and link.dialled and loop.time() - started < 0.1
            assert await call(link, [b"x"]) == [b"x"] and a.echo.calls == [B]
            assert b.pool.dials == 1 and a.pool.dials == 0
        finally:
            for member in swarm.values():
                await member.close()

    run(main)


def test_an_acceptor_calls_the_dialler_only_under_its_own_identity_and_in_turn() -> None:
    """The acceptor's identity is the one whose ticket the dialler redeemed (the pinned
    certificate), whatever it claims: its calls reach the dialler's handler under that identity.
    Parts for a call that has finished are dropped; a call with a number of the dialler's breaks
    the link (its own), never another."""

    async def main() -> None:
        cert, tickets = make_server_cert(), Tickets()
        echo = Echo()
        opened: list[int] = []

        async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            _kind, _call, token = await read_frame(reader)
            assert tickets.redeem(token) == A
            write_frame(writer, Kind.HELLO)
            await writer.drain()
            if not opened:  # a call of its own, in turn: answered, under its pinned identity
                write_frame(writer, Kind.DATA, part(b"mine").SerializeToString(), 2)
                write_frame(writer, Kind.END, call=2)
                await writer.drain()
                kind, number, _ = await read_frame(reader)
                assert (kind, number) == (Kind.CREDIT, 2)
                kind, number, payload = await read_frame(reader)
                assert (kind, number) == (Kind.DATA, 2)
                opened.append(2)
                write_frame(writer, Kind.DATA, part(b"again").SerializeToString(), 2)  # a finished call reopened
                write_frame(writer, Kind.DATA, part(b"odd").SerializeToString(), 5)  # the dialler's number
            else:
                write_frame(writer, Kind.DATA, part(b"odd").SerializeToString(), 1)
                opened.append(1)
            await writer.drain()
            await reader.read()

        fake = await asyncio.start_server(hostile, "127.0.0.1", 0, ssl=cert.context)
        port = fake.sockets[0].getsockname()[1]

        async def ticket(_peer: PeerID) -> Ticket:
            return Ticket(port, cert.pin, tickets.issue(A))

        pool = BulkPool(ticket, _loopback, handler=echo, local_id=A, dial_s=5.0)
        try:
            for attempt in range(2):
                link = await pool.open(B)
                assert link is not None and pool.dials == attempt + 1
                async with asyncio.timeout(10):
                    while link.broken is None:
                        await asyncio.sleep(0.02)
                assert not link.alive() and pool.kept(B) == 0
            assert echo.calls == [B] and echo.parts == [b"mine"]  # the reopened call and the odd ones: never
        finally:
            pool.close()
            fake.close()

    run(main)
