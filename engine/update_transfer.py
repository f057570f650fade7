"""Kept updates between members: a member keeps the averaged update of each round that landed
here (``engine.update_store``) and serves it to admitted peers; a newcomer that holds the state
of round r downloads round r's update, rolls its state forward (``peer.round.host_passes.roll_forward``) and asks
for the next, until it holds the swarm's latest state. Mixed into ``engine.averager.ExactAverager``.

The wire: one request per update, an ``AveragingData`` whose spare ``peer_id`` field holds
``[round, digest]`` (the state the requester holds); the answer is a stream of one header
message (``peer_id``: ``[round, pre, post, left_out, parts, bytes]``, no tensor) and then the
update's parts in vector order (``peer_id``: the part's start; ``tensor_part``: the reducer's
bytes). A server that does not hold the update answers ``BAD_GROUP_ID``. The downloader checks
every field before it takes the next message, caps what it reads, and the host checks the
digest of the state the update makes: a server can waste a downloader's time, never change
what it adopts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import typing
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from engine.allreduce import MAX_PART_VALUES, CodecCompression, part_numel
from engine.state_transfer import SLOWEST_LINK_BYTES_S
from engine.stream_close import until_reader_closes
from engine.update_store import KeptUpdate, PendingUpdate, UpdateStore, read_frames
from engine.wire_fields import read_fields
from protocol.errors import MalformedTensorError
from protocol.updates import FetchedUpdate, left_out_between, parse_ranges

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256
"""A request's ``[round, digest]``: ~80 bytes; more is refused unread."""
MAX_HEADER_BYTES = 64 * 1024
"""An update's header: its digests and left-out ranges (a few per failed reducer)."""
MAX_SERVING = 4
"""Updates this member streams at once; more requests are answered "busy"."""
T = TypeVar("T")
SERVERS_TTL_S = 60.0
"""How long a newcomer's list of members to ask stays good (members live for many rounds; one
that left answers nothing and is asked last): a list read as its state download began still
serves when it ends, saving a DHT lookup (0.75 s on a 220 kbit/s link) on the way in."""
SLOW_SERVER_S = 15.0
"""How long a server that was slow to answer (``ANSWER_TIMEOUT_S``) is asked only when no faster
one is there to ask."""
OPEN_TIMEOUT_S = 10.0
"""The longest a member that is gone (its ``all_averagers`` entry lives 30 s) holds up the search."""
ANSWER_TIMEOUT_S = 3.0
"""The longest a server may take to say whether it keeps the update asked for (a header or "none",
a few bytes): one slower (a busy archive took 5-10 s), or one that failed (gone: the dial
fails), is left out for ``SLOW_SERVER_S`` where another answered, so that it does not hold up a newcomer asking every quarter second whether a
round's update is kept, nor each chain's end by this timeout."""
MAX_SERVERS_ASKED = 8
"""Members asked for one update, at random: in a swarm of thousands a newcomer whose state no
member rolled from (it diverged) finds out after a few requests, not thousands."""
PREFETCH_BYTES = 256 << 20
"""A newcomer holds at most about this much of a chain at once (the first update whatever its
size): it closes the answer there and asks again from where it stopped."""
MAX_CHAIN = 64
"""Updates one answer streams at most (a newcomer asks again from where it ends)."""
SLACK_BYTES = 1 << 20

_Header = tuple[int, str, str, tuple[tuple[int, int], ...], int, int]
"""round, pre, post, left_out, parts, more"""
"""An update's (round, pre, post, left-out ranges, updates that follow it in the stream)."""


class UpdateTransferMixin:
    """``keep_update`` and ``download_update`` (host process) and the averager-process side."""

    update_store: UpdateStore | None
    numel: int
    prefix: str
    dht: Any
    peer_id: PeerID
    serializer: Any
    codec_compression: CodecCompression
    _outer_pipe: Any
    _p2p: Any
    _matchmaking: Any

    if TYPE_CHECKING:

        async def _admitted(self, peer: PeerID, *, stale_ok: bool = False) -> bool: ...

        def get_stub(self, p2p: Any, peer: PeerID, *, namespace: str | None = None) -> Any: ...

    def _spool(self) -> dict[int, asyncio.Future[None]]:
        return self.__dict__.setdefault("_update_spool", {})

    def _serving(self) -> asyncio.Semaphore:
        semaphore = self.__dict__.get("_update_serving")
        if semaphore is None:
            semaphore = self.__dict__["_update_serving"] = asyncio.Semaphore(MAX_SERVING)
        return semaphore

    # --- keeping (the averager process, at the end of an all-reduce; the host, once it landed)

    def _pending_update(self, round_: int) -> PendingUpdate | None:
        """The round's update, written part by part as the parts arrive (``UpdateStore.pending``);
        None if this peer keeps none."""
        return None if self.update_store is None else self.update_store.pending(round_)

    def _spool_update(self, round_: int, pending: PendingUpdate | None) -> None:
        """Every averaged part is in: the round's file completed on a thread (the all-reduce's
        result is not held up by the disk); ``keep_update`` waits for it."""
        if pending is None:
            return
        spool = self._spool()
        spool[round_] = asyncio.get_running_loop().run_in_executor(None, pending.finish)
        for old in [r for r in spool if r < round_ - 1]:
            spool.pop(old, None)

    def keep_update(self, round_: int, pre: str, post: str, left_out: Sequence[tuple[int, int]]) -> None:
        """The round averaged last landed here, from state ``pre`` to ``post``: keep its update
        for newcomers (nothing if this peer keeps none)."""
        ranges = [(int(lo), int(hi)) for lo, hi in left_out]
        self._outer_pipe.send(("_keep_update", [], dict(round_=round_, pre=pre, post=post, left_out=ranges)))

    async def _keep_update(self, round_: int, pre: str, post: str, left_out: list[tuple[int, int]]) -> None:
        if self.update_store is None:
            return
        writing = self._spool().pop(round_, None)
        try:
            if writing is not None:
                await writing
            if not self.update_store.keep(round_, pre, post, left_out):
                logger.info("no update of round %d to keep (this peer's all-reduce did not end here)", round_)
        except Exception:  # a disk error costs newcomers this round, never the round
            logger.exception("could not keep round %d's update", round_)

    # --- serving (the averager process)

    async def rpc_download_update(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """The kept update that takes the requester's state forward by one round. (Annotated
        with ``typing.AsyncIterator``: hivemind's servicer reads a stream from that alone.)"""
        async for message in until_reader_closes(self._serve_update(request, context)):
            yield message

    async def _serve_update(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.update_store is None:  # keeps none (a client, the coordinator's archive): say so at once
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        if not await self._admitted(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        asked = self._parse_request(request.peer_id)
        chain = [] if asked is None else self.update_store.chain(*asked)
        if not chain:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        semaphore = self._serving()
        if semaphore.locked():
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        chain = chain[:MAX_CHAIN]
        loop = asyncio.get_running_loop()
        async with semaphore:
            for index, update in enumerate(chain):
                more = len(chain) - 1 - index
                yield averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE, peer_id=self._header(update, more))
                frames = read_frames(update.path, update.order)
                while (frame := await loop.run_in_executor(None, next, frames, None)) is not None:
                    start, raw = frame
                    part = runtime_pb2.Tensor()
                    part.ParseFromString(raw)
                    yield averaging_pb2.AveragingData(
                        code=averaging_pb2.PART_FOR_AVERAGING, peer_id=self.serializer.dumps(start), tensor_part=part
                    )

    def _header(self, update: KeptUpdate, more: int) -> bytes:
        left_out = [list(pair) for pair in update.left_out]
        fields = [update.round, update.pre, update.post, left_out, update.parts, update.size, more]
        return bytes(self.serializer.dumps(fields))

    def _parse_request(self, raw: bytes) -> tuple[int, str] | None:
        values = read_fields(self.serializer, raw, 2, MAX_REQUEST_BYTES)
        if values is None:
            return None
        round_, digest = values
        if type(round_) is not int or round_ < 0 or not isinstance(digest, str):
            return None
        return round_, digest

    # --- downloading (host process, then the averager process)

    def download_update(self, round_: int, digest: str, timeout: float) -> FetchedUpdate | None:
        """The update that takes the state of ``round_`` (``digest``) one round forward, from an
        admitted member that keeps it; None if none did. ``timeout``: the longest a server may
        go without sending anything (a slow link takes as long as it takes)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(
            ("_download_update", [], dict(round_=round_, digest=digest, timeout=timeout, future=future))
        )
        return future.result(timeout=timeout * 4 + 10 + 4 * self.numel / SLOWEST_LINK_BYTES_S)

    async def _download_update(self, round_: int, digest: str, timeout: float, future: MPFuture) -> None:
        try:
            prefetched = self.__dict__.setdefault("_prefetched", {})
            update = prefetched.pop((round_, digest), None)
            if update is not None:  # the rest of a chain a member streamed with the last one
                future.set_result(update)
                return
            prefetched.clear()
            listing = time.monotonic()
            servers = await self._update_servers()
            logger.debug(
                "round %d: %d servers to ask, listed in %.2f s", round_, len(servers), time.monotonic() - listing
            )
            slow: dict[PeerID, float] = self.__dict__.setdefault("_slow_servers", {})
            for peer in servers:
                if peer in slow and servers[0] not in slow:
                    # the fast ones had nothing more: a slow one answers the same seconds later
                    # (asked at each chain's end, it cost a newcomer 3 s a round)
                    break
                asked = time.monotonic()
                try:
                    chain = await self._download_chain_from(peer, round_, digest, timeout)
                except Exception as exc:  # noqa: BLE001 - any failure of one peer: try the next
                    # a member gone (its listing lives on a while) fails to dial, a busy one
                    # times out: either is asked last for ``SLOW_SERVER_S``, not again at each
                    # quarter-second ask (a dial to a dead peer costs a newcomer up to
                    # ``OPEN_TIMEOUT_S``; the soak's logs showed three failed dials a second)
                    logger.info("no update of round %d from %s: %s", round_, peer, str(exc) or type(exc).__name__)
                    slow[peer] = time.monotonic()
                    continue
                logger.debug(
                    "round %d on: %d updates from %s in %.2f s", round_, len(chain), peer, time.monotonic() - asked
                )
                if chain:
                    self.__dict__["_update_server"] = peer  # asked first for the next round's
                    prefetched.update({(later.round, later.pre): later for later in chain[1:]})
                    future.set_result(chain[0])
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _update_servers(self) -> list[PeerID]:
        """Up to ``MAX_SERVERS_ASKED`` admitted members to ask, at random, the one that served the
        last update first; the members are read from the DHT at most every ``SERVERS_TTL_S``
        (a newcomer rolling forward by many rounds over a slow link asks for one per round)."""
        listed, read_at = self.__dict__.get("_update_listing", ([], -SERVERS_TTL_S))
        if time.monotonic() - read_at >= SERVERS_TTL_S:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await self.dht.get(key, latest=True, return_future=True)
            listed = list(found.value.keys()) if found is not None and isinstance(found.value, dict) else []
            self.__dict__["_update_listing"] = (listed, time.monotonic())
        peers: list[PeerID] = []
        for raw_peer in random.sample(listed, len(listed)):
            try:
                peer = PeerID(raw_peer)
            except Exception:  # noqa: BLE001 - a malformed DHT subkey
                continue
            # a member at the last lookup serves at once, the lookup renewed behind it (a
            # second on a home link, right after a state download); what it serves is
            # verified by digest against the records whoever serves it
            if peer != self.peer_id and await self._admitted(peer, stale_ok=True):
                peers.append(peer)
        slow: dict[PeerID, float] = self.__dict__.setdefault("_slow_servers", {})
        for peer in [peer for peer, at in slow.items() if time.monotonic() - at >= SLOW_SERVER_S]:
            del slow[peer]
        peers.sort(key=lambda peer: peer in slow)  # stable: the rest stay at random
        last = self.__dict__.get("_update_server")
        if last in peers:
            peers.remove(last)
            peers.insert(0, last)
        return peers[:MAX_SERVERS_ASKED]

    async def _download_chain_from(self, peer: PeerID, round_: int, digest: str, timeout: float) -> list[FetchedUpdate]:
        """The kept updates ``peer`` streams from the state of ``round_`` (``digest``) on, in
        order (it sends as many as it keeps unbroken, at most ``MAX_CHAIN``); empty if it keeps
        none. Each header must continue the one before, each update cover the vector in order."""
        started = time.monotonic()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        request = averaging_pb2.AveragingData(peer_id=self.serializer.dumps([round_, digest]))
        stream = await asyncio.wait_for(stub.rpc_download_update(request), min(timeout, OPEN_TIMEOUT_S))
        tag = self.codec_compression.dtype_tag
        limit = int(self.numel * (self.codec_compression.codec.bytes_per_value() + 0.25)) + SLACK_BYTES
        chain: list[FetchedUpdate] = []
        header: _Header | None = None
        parts: list[tuple[int, int, bytes]] = []
        cursor = received = more = 0
        try:
            async for message in _answered(stream, timeout):
                if header is None:
                    if message.code == averaging_pb2.BAD_GROUP_ID and not chain:
                        return []  # it keeps no such update
                    if message.code != averaging_pb2.NO_CODE:
                        raise MalformedTensorError(f"it answered {averaging_pb2.MessageCode.Name(message.code)}")
                    if chain:  # the next update of the chain
                        previous = chain[-1]
                        header = self._parse_header(message.peer_id, previous.round + 1, previous.post, more - 1)
                    else:
                        header = self._parse_header(message.peer_id, round_, digest, None)
                    parts, cursor, received = [], 0, 0
                    continue
                if message.code != averaging_pb2.PART_FOR_AVERAGING or message.tensor_part.dtype != tag:
                    raise MalformedTensorError(f"part {len(parts)} is not a {tag} part")
                start = self.serializer.loads(message.peer_id) if len(message.peer_id) <= 16 else None
                if type(start) is not int or not (start == cursor or left_out_between(header[3], cursor, start)):
                    raise MalformedTensorError(f"part {len(parts)} starts at {start}, expected {cursor}")
                values = part_numel(message.tensor_part.size)
                received += len(message.tensor_part.buffer)
                if not 0 < values <= MAX_PART_VALUES or start + values > self.numel or received > limit:
                    raise MalformedTensorError(f"part {len(parts)} runs past the vector or the update's size")
                parts.append((start, values, bytes(message.tensor_part.buffer)))
                cursor = start + values
                if len(parts) == header[4]:  # as many parts as its header said: they must cover the vector
                    if not (cursor == self.numel or left_out_between(header[3], cursor, self.numel)):
                        raise MalformedTensorError(f"update ends at {cursor} of {self.numel} values")
                    at = time.monotonic()
                    chain.append(FetchedUpdate(*header[:4], parts, at - started, str(peer)))
                    started, more, header = at, header[5], None
                    if more == 0 or sum(update.size for update in chain) >= PREFETCH_BYTES:
                        break  # the whole chain is here (or all we hold at once): close the stream
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
        if not chain:
            raise MalformedTensorError(f"update ended after {len(parts)} parts, {cursor} of {self.numel} values")
        return chain  # a chain cut short: the updates that arrived whole

    def _parse_header(self, raw: bytes, round_: int, digest: str, more: int | None) -> _Header:
        """An update's header: it must be the update of ``round_`` from ``digest``, and say that
        ``more`` updates follow it (the first of a chain: fewer than ``MAX_CHAIN``)."""
        values = read_fields(self.serializer, raw, 7, MAX_HEADER_BYTES)
        if values is None:
            raise MalformedTensorError("update header malformed, unreadable or too large")
        got_round, pre, post, left_out, parts, _size, following = values
        if got_round != round_ or pre != digest:
            raise MalformedTensorError(f"serves the update of round {got_round!r}, not the one asked for")
        if not isinstance(post, str) or len(post) > 128 or type(parts) is not int or parts < 1:
            raise MalformedTensorError("update header malformed")
        if type(following) is not int or not 0 <= following < MAX_CHAIN or (more is not None and following != more):
            raise MalformedTensorError("update header malformed: the chain's length")
        ranges = parse_ranges(left_out, self.numel)
        if parts > self.numel:
            raise MalformedTensorError("update header malformed: more parts than values")
        return got_round, pre, post, ranges, parts, following


async def _answered(stream: AsyncIterator[T], timeout: float) -> AsyncIterator[T]:
    """``stream``'s messages: the first within ``ANSWER_TIMEOUT_S`` (or ``timeout`` if shorter),
    each next within ``timeout`` of the last (``asyncio.TimeoutError`` otherwise)."""
    iterator = aiter(stream)
    try:
        first = await asyncio.wait_for(anext(iterator), min(timeout, ANSWER_TIMEOUT_S))
    except StopAsyncIteration:
        return
    yield first
    async for message in aiter_with_timeout(iterator, timeout):
        yield message
