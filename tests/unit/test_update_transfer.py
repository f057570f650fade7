"""Kept updates: what a member keeps (``engine.update_store``), what it serves and to whom, and
what a newcomer takes from a server (``engine.update_transfer``): everything a hostile server
could send instead is refused before the next message is read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer

from engine.allreduce import CodecCompression
from engine.codecs import get_codec
from engine.update_store import UpdateStore, read_frames
from engine.update_transfer import MAX_SERVING, UpdateTransferMixin
from protocol.errors import MalformedTensorError
from tests.unit.update_answers import _Answer

NUMEL = 64 * 300
WIDTH = 64 * 70  # values per part: whole blocks, the last part shorter
CODEC = CodecCompression(get_codec("int8"))


class _Context:
    def __init__(self, remote_id: str) -> None:
        self.remote_id = remote_id


class _Member(UpdateTransferMixin):
    """A member's averager side: a store and the admission gate's answer."""

    def __init__(self, store: UpdateStore | None, admitted: set[str] = frozenset({"newcomer"})) -> None:  # type: ignore[assignment]
        self.update_store, self.numel, self.serializer = store, NUMEL, MSGPackSerializer
        self.codec_compression = CODEC
        self.admitted = set(admitted)

    async def _admitted(self, peer: Any) -> bool:
        return str(peer) in self.admitted


class _Stub:
    def __init__(self, serve: Any) -> None:
        self.serve = serve

    async def rpc_download_update(self, request: averaging_pb2.AveragingData) -> AsyncIterator[Any]:
        return self.serve(request)


class _Newcomer(_Member):
    def __init__(self, serve: Any) -> None:
        super().__init__(None)
        self.prefix, self._p2p, self.stub = "test", None, _Stub(serve)

    def get_stub(self, p2p: Any, peer: Any, *, namespace: str | None = None) -> Any:
        return self.stub

    def fetch_chain(self, round_: int, digest: str, timeout: float = 5.0) -> Any:
        return asyncio.run(self._download_chain_from("member", round_, digest, timeout))  # type: ignore[arg-type]

    def fetch(self, round_: int, digest: str, timeout: float = 5.0) -> Any:
        chain = self.fetch_chain(round_, digest, timeout)
        return chain[0] if chain else None


def _parts(round_: int) -> list[tuple[int, runtime_pb2.Tensor]]:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_)) * 1e-3
    dither = torch.rand(WIDTH + 64, generator=torch.Generator().manual_seed(round_))
    return [(start, CODEC.compress_average(values[start : start + WIDTH], dither)) for start in range(0, NUMEL, WIDTH)]


def _served_by(member: _Member, who: str = "newcomer") -> Any:
    return lambda request: member.rpc_download_update(request, _Context(who))  # type: ignore[arg-type]


def _kept(tmp_path: Path, rounds: int = 2, keep: int = 4) -> UpdateStore:
    store = UpdateStore(tmp_path / "updates", keep=keep)
    for round_ in range(3, 3 + rounds):
        store.write_pending(round_, list(reversed(_parts(round_))))  # any order in, vector order out
        assert store.keep(round_, f"d{round_}", f"d{round_ + 1}", [(64, 128)] if round_ == 4 else [])
    return store


def test_a_member_keeps_the_rounds_that_landed_here_and_the_newest_few(tmp_path: Path) -> None:
    store = UpdateStore(tmp_path / "updates", keep=2)
    store.write_pending(3, _parts(3))
    assert not store.keep(9, "a", "b", [])  # no all-reduce of round 9 ended here
    store.write_pending(4, _parts(4))  # round 3's pending update never landed: a newer one came
    assert store.keep(4, "d4", "d5", []) and store.rounds() == [4]
    for round_ in (5, 6):
        store.write_pending(round_, _parts(round_))
        store.keep(round_, f"d{round_}", f"d{round_ + 1}", [])
    assert store.rounds() == [5, 6]
    assert sorted(p.name for p in (tmp_path / "updates").iterdir()) == ["round-5.bin", "round-6.bin"]
    assert [u.round for u in store.chain(5, "d5")] == [5, 6]
    assert store.chain(5, "d-other") == [] and store.chain(4, "d4") == []
    kept = store.chain(6, "d6")[0]
    frames = list(read_frames(kept.path, kept.order))
    assert [start for start, _ in frames] == list(range(0, NUMEL, WIDTH))
    store.close()
    assert not (tmp_path / "updates").exists()


def test_an_update_is_written_part_by_part_as_they_arrive_and_kept_only_whole(tmp_path: Path) -> None:
    store = UpdateStore(tmp_path / "updates", keep=4)
    parts = _parts(3)
    first = store.pending(3)
    first.add(*parts[2])
    retry = store.pending(3)  # the same round again (the first try failed here): a file of its own
    assert not first.path.exists() and retry.path.exists()
    fragment = retry.at(parts[1][0])  # a fragment's parts, their starts within it
    for start, part in reversed(parts):  # arrival order, not vector order
        if start == parts[1][0]:
            fragment(0, part)
        else:
            retry.add(start, part)
    first.add(*parts[0])  # a dropped writer's late part goes nowhere
    assert not store.keep(3, "d3", "d4", [])  # not finished: every part was not in
    assert not retry.path.exists()
    whole = store.pending(3)
    for start, part in reversed(parts):
        whole.add(start, part)
    whole.finish()
    assert store.keep(3, "d3", "d4", [])
    unfinished = store.pending(4)
    assert store.pending(6) and not unfinished.path.exists()  # a newer round's began: round 4's never landed
    kept = store.chain(3, "d3")[0]
    assert kept.parts == len(parts) and kept.size == sum(len(part.buffer) for _, part in parts)
    in_order = [(start, raw) for start, raw in read_frames(kept.path, kept.order)]
    assert in_order == [(start, part.SerializeToString()) for start, part in parts]
    assert [start for start, _ in read_frames(kept.path)] == [start for start, _ in reversed(parts)]


def test_a_member_keeps_its_updates_within_a_disk_budget_but_always_the_newest(tmp_path: Path) -> None:
    size = sum(len(part.buffer) for _, part in _parts(3))
    store = UpdateStore(tmp_path / "updates", keep=16, max_bytes=2 * size)
    for round_ in range(3, 7):
        store.write_pending(round_, _parts(round_))
        store.keep(round_, f"d{round_}", f"d{round_ + 1}", [])
    assert store.rounds() == [5, 6]
    tiny = UpdateStore(tmp_path / "tiny", keep=16, max_bytes=1)
    tiny.write_pending(3, _parts(3))
    tiny.keep(3, "d3", "d4", [])
    assert tiny.rounds() == [3]


def test_a_newcomer_downloads_the_chain_of_rounds_as_they_were_averaged_in_one_answer(tmp_path: Path) -> None:
    member = _Member(_kept(tmp_path))
    newcomer = _Newcomer(_served_by(member))
    first, second = newcomer.fetch_chain(3, "d3")
    assert (first.round, first.pre, first.post, first.left_out) == (3, "d3", "d4", ())
    assert [(start, values, buffer) for start, values, buffer in first.parts] == [
        (start, part.size[0], part.buffer) for start, part in _parts(3)
    ]
    assert (second.round, second.pre, second.post, second.left_out) == (4, "d4", "d5", ((64, 128),))
    assert [u.round for u in newcomer.fetch_chain(4, "d4")] == [4]  # from the middle on
    assert newcomer.fetch(5, "d5") is None  # not kept (yet): the newcomer asks another member
    assert newcomer.fetch(3, "d-forged") is None  # from another state: not this member's chain


def test_a_round_that_left_a_failed_reducers_range_out_is_kept_and_served_without_it(tmp_path: Path) -> None:
    store = UpdateStore(tmp_path / "updates", keep=4)
    arrived = [part for index, part in enumerate(_parts(3)) if index != 1]  # reducer 1 failed: none of its parts
    store.write_pending(3, arrived)
    assert store.keep(3, "d3", "d4", [(WIDTH, 2 * WIDTH)])
    update = _Newcomer(_served_by(_Member(store))).fetch(3, "d3")
    assert update.left_out == ((WIDTH, 2 * WIDTH),)
    assert [(start, buffer) for start, _values, buffer in update.parts] == [(s, p.buffer) for s, p in arrived]


def test_a_peer_that_keeps_no_updates_says_so_at_once_to_anyone(tmp_path: Path) -> None:
    """The coordinator's archive and client-mode peers keep none: they answer before any
    admission lookup (which costs a DHT read), so a newcomer asking them loses no time."""
    archive = _Member(None, admitted=set())
    assert _Newcomer(_served_by(archive)).fetch(3, "d3") is None


def test_an_outsider_or_a_malformed_request_gets_nothing(tmp_path: Path) -> None:
    member = _Member(_kept(tmp_path))
    with pytest.raises(MalformedTensorError, match="PROTOCOL_VIOLATION"):
        _Newcomer(_served_by(member, who="stranger")).fetch(3, "d3")

    async def ask(raw: bytes) -> list[Any]:
        request = averaging_pb2.AveragingData(peer_id=raw)
        return [m async for m in member._serve_update(request, _Context("newcomer"))]  # type: ignore[arg-type]

    for raw in (b"\xc1", MSGPackSerializer.dumps([3]), MSGPackSerializer.dumps([-1, "d3"]), b"x" * 300):
        (answer,) = asyncio.run(ask(raw))
        assert answer.code == averaging_pb2.BAD_GROUP_ID


def test_a_member_serves_a_few_newcomers_at_once_and_tells_the_others_it_is_busy(tmp_path: Path) -> None:
    member = _Member(_kept(tmp_path))

    async def crowd() -> list[int]:
        request = averaging_pb2.AveragingData(peer_id=MSGPackSerializer.dumps([3, "d3"]))
        streams = [member._serve_update(request, _Context("newcomer")) for _ in range(MAX_SERVING + 1)]
        firsts = [await anext(stream) for stream in streams]  # each holds its place mid-stream
        for stream in streams:
            await stream.aclose()
        return [m.code for m in firsts]

    codes = asyncio.run(crowd())
    assert codes.count(averaging_pb2.NO_CODE) == MAX_SERVING and codes[-1] == averaging_pb2.INTERNAL_ERROR


def _header(**change: Any) -> averaging_pb2.AveragingData:
    fields = {"round": 3, "pre": "d3", "post": "d4", "left_out": [], "parts": 5, "size": 1, "more": 0}
    fields.update(change)
    return averaging_pb2.AveragingData(
        code=averaging_pb2.NO_CODE, peer_id=MSGPackSerializer.dumps(list(fields.values()))
    )


def _part(start: Any, part: runtime_pb2.Tensor) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING, peer_id=MSGPackSerializer.dumps(start), tensor_part=part
    )


def _honest() -> list[averaging_pb2.AveragingData]:
    return [_header(), *(_part(start, part) for start, part in _parts(3))]


def _replace_part(index: int, **fields: Any) -> list[averaging_pb2.AveragingData]:
    messages = _honest()
    part = runtime_pb2.Tensor()
    part.CopyFrom(messages[index].tensor_part)
    for name, value in fields.items():
        if name == "size":
            del part.size[:]
            part.size.extend(value)
        else:
            setattr(part, name, value)
    messages[index] = _part(MSGPackSerializer.loads(messages[index].peer_id), part)
    return messages


HOSTILE = {
    "another round": [_header(round=4), *_honest()[1:]],
    "another start state": [_header(pre="d-other"), *_honest()[1:]],
    "left-out ranges past the vector": [_header(left_out=[[0, NUMEL + 1]]), *_honest()[1:]],
    "overlapping left-out ranges": [_header(left_out=[[0, 64], [32, 96]]), *_honest()[1:]],
    "left-out ranges that are not numbers": [_header(left_out=[["0", 64]]), *_honest()[1:]],
    "a header that is not a list": [
        averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE, peer_id=MSGPackSerializer.dumps({"round": 3})),
        *_honest()[1:],
    ],
    "a huge claimed digest": [_header(post="b" * 1000), *_honest()[1:]],
    "a part first": _honest()[1:],
    "a gap between parts": [_header(), *_honest()[2:]],
    "a part that starts elsewhere": [_header(), _part(64, _honest()[1].tensor_part), *_honest()[2:]],
    "a start that is not a number": [_header(), _part(True, _honest()[1].tensor_part), *_honest()[2:]],
    "another codec": _replace_part(2, dtype="swarmtrain:none"),
    "a part running past the vector": _replace_part(-1, size=[NUMEL]),
    "a part of no values": _replace_part(1, size=[0]),
    "more bytes than an update holds": _replace_part(1, buffer=b"\0" * (2 * NUMEL + (1 << 20))),
    "a stream that ends early": _honest()[:-1],
    "a chain whose next update is not the next round's": [
        _header(more=1),
        *_honest()[1:],
        _header(round=5, pre="d4", post="d6"),
        *_honest()[1:],
    ],
    "a chain whose next update starts elsewhere": [
        _header(more=1),
        *_honest()[1:],
        _header(round=4, pre="d-other", post="d5"),
        *_honest()[1:],
    ],
    "a chain whose count does not go down": [
        _header(more=1),
        *_honest()[1:],
        _header(round=4, pre="d4", post="d5", more=1),
        *_honest()[1:],
    ],
    "a chain longer than any answer": [_header(more=10_000), *_honest()[1:]],
    "a gap the left-out ranges do not cover": [_header(left_out=[[0, 64]], parts=4), *_honest()[2:]],
    "a gap covered, then a part going back into it": [
        _header(left_out=[[0, WIDTH]], parts=5),
        *_honest()[2:],
        _honest()[1],
    ],
    "fewer parts than its header says": [_header(parts=6), *_honest()[1:]],
    "more parts than its header says, short of the vector": [_header(parts=4), *_honest()[1:]],
    "a part count past the vector": [_header(parts=NUMEL + 1), *_honest()[1:]],
    "an answer code that is not an update": [averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)],
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_what_a_hostile_server_sends_instead_of_an_update_is_refused(attack: str) -> None:
    async def serve(_request: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        for message in HOSTILE[attack]:
            yield message

    with pytest.raises(MalformedTensorError):
        _Newcomer(serve).fetch(3, "d3")


def test_a_chain_cut_short_gives_the_updates_that_arrived_whole() -> None:
    async def serve(_request: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        for message in [
            _header(more=2),
            *_honest()[1:],
            _header(round=4, pre="d4", post="d5", more=1),
            *_honest()[1:3],
        ]:
            yield message

    (first,) = _Newcomer(serve).fetch_chain(3, "d3")
    assert first.post == "d4"


def test_a_server_that_stops_sending_is_given_up_after_the_timeout() -> None:
    async def stall(_request: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield _honest()[0]
        await asyncio.sleep(60)
        yield _honest()[1]

    with pytest.raises(TimeoutError):
        _Newcomer(stall).fetch(3, "d3", timeout=0.3)


def test_a_server_slow_to_say_whether_it_keeps_the_update_is_given_up_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first answer is a few bytes: a server that takes longer than ``ANSWER_TIMEOUT_S`` (a
    busy archive took 10 s) is not waited for as long as a transfer's silence may last."""
    import engine.update_transfer

    monkeypatch.setattr(engine.update_transfer, "ANSWER_TIMEOUT_S", 0.2)

    async def slow(_request: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        await asyncio.sleep(60)
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _Newcomer(slow).fetch(3, "d3", timeout=30.0)
    assert time.monotonic() - started < 5.0


def test_an_honest_stream_of_the_same_messages_is_taken() -> None:
    honest = [_header(more=1), *_honest()[1:], _header(round=4, pre="d4", post="d5"), *_honest()[1:]]

    async def serve(_request: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        for message in honest:
            yield message

    first, second = _Newcomer(serve).fetch_chain(3, "d3")
    assert first.post == "d4" and sum(values for _, values, _ in first.parts) == NUMEL
    assert (second.round, second.pre, second.post) == (4, "d4", "d5")


def test_hivemind_serves_the_update_download_as_a_stream() -> None:
    """hivemind's servicer reads a stream from ``typing.AsyncIterator`` alone: with another
    annotation the stub would hand the caller a generator it cannot await."""
    from engine.averager import ExactAverager

    ExactAverager._collect_rpc_handlers()
    (handler,) = [h for h in ExactAverager._rpc_handlers if h.method_name == "rpc_download_update"]
    assert handler.stream_output and not handler.stream_input
    assert handler.response_type is averaging_pb2.AveragingData


def test_a_server_once_slow_is_not_asked_where_a_faster_one_had_nothing() -> None:
    """At each chain's end every member is asked whether it keeps one more round: one slow to
    answer (a busy archive) cost the newcomer ``ANSWER_TIMEOUT_S`` there every round. Where a
    faster server answered, it is left out; where it is the only one, it is still asked."""
    asked: list[str] = []

    class Asker(_Newcomer):
        def __init__(self, servers: list[str]) -> None:
            super().__init__(None)
            self.servers = servers
            self.__dict__["_slow_servers"] = {"archive": time.monotonic()}

        async def _update_servers(self) -> list[Any]:
            return list(self.servers)

        async def _download_chain_from(self, peer: Any, round_: int, digest: str, timeout: float) -> list[Any]:
            asked.append(peer)
            return []

    answer = _Answer()
    asyncio.run(Asker(["member", "archive"])._download_update(3, "d3", 5.0, answer))  # type: ignore[arg-type]
    assert asked == ["member"] and answer.result is None
    asked.clear()
    asyncio.run(Asker(["archive"])._download_update(3, "d3", 5.0, _Answer()))  # type: ignore[arg-type]
    assert asked == ["archive"]


def test_a_server_that_failed_to_dial_is_asked_last_and_not_again_at_once() -> None:
    """A member gone (its listing outlives it) fails to dial: a newcomer rolling forward asks
    four times a second whether the next round's update is kept, and asked the dead member each
    time (three failed dials a second in the soak's logs, each up to ``OPEN_TIMEOUT_S`` on a
    real network). Once it failed it waits behind the others, like a slow one."""
    asked: list[str] = []

    class Asker(_Newcomer):
        def __init__(self) -> None:
            super().__init__(None)

        async def _update_servers(self) -> list[Any]:
            slow = self.__dict__.setdefault("_slow_servers", {})
            return sorted(["gone", "member"], key=lambda peer: peer in slow)  # as the real listing sorts

        async def _download_chain_from(self, peer: Any, round_: int, digest: str, timeout: float) -> list[Any]:
            asked.append(peer)
            if peer == "gone":
                raise ConnectionError("failed to dial: all dials failed")
            return []

    asker = Asker()
    asyncio.run(asker._download_update(3, "d3", 5.0, _Answer()))  # type: ignore[arg-type]
    assert sorted(asked) == ["gone", "member"]
    asked.clear()
    asyncio.run(asker._download_update(3, "d3", 5.0, _Answer()))  # type: ignore[arg-type]
    assert asked == ["member"]
