"""Auditing reducers (``engine.audit``, ``engine.auditing``): who audits whom, that a
re-computation reproduces the reducer's own bytes, what counts as a wrong average, and what
the two audit handlers refuse (strangers, malformed requests, more requests than an audit
needs, a second verdict). A 4-peer run with a lying reducer:
``tests/integration/test_hostile_peers.py``."""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from engine.allreduce import CodecCompression, InPlaceOutputs, RobustPartReducer
from engine.audit import MIN_FLIPS, AuditTarget, SentParts, auditee, choose_target, judge, reduce_like_a_reducer
from engine.auditing import UNSERVED, AuditMixin, AuditRoom
from engine.codecs import get_codec
from engine.robust import RobustRule

RULE = RobustRule()


@pytest.mark.parametrize("members", range(2, 12))
def test_every_reducer_has_exactly_one_auditor_and_nobody_audits_itself(members: int) -> None:
    for seed in range(40):
        group_id = os.urandom(20) if seed else b"fixed"
        targets = [auditee(group_id, member, range(members)) for member in range(members)]
        assert sorted(t for t in targets if t is not None) == list(range(members)), targets
        assert all(target != member for member, target in enumerate(targets))


def test_clients_audit_a_reducer_and_a_lone_reducer_is_audited_by_the_others() -> None:
    group_id = b"g" * 20
    # members 0 and 1 reduce, 2 and 3 are clients (they send, reduce nothing)
    assert auditee(group_id, 0, [0, 1]) == 1 and auditee(group_id, 1, [0, 1]) == 0
    assert {auditee(group_id, 2, [0, 1]), auditee(group_id, 3, [0, 1])} <= {0, 1}
    assert auditee(group_id, 0, [0]) is None  # nobody else to audit
    assert auditee(group_id, 1, [0]) == 0


def test_the_target_part_is_the_auditors_own_choice() -> None:
    seen = {choose_target(2, [3, 0, 2]) for _ in range(400)}
    assert seen == {
        AuditTarget(0, 2, 0),
        AuditTarget(0, 2, 1),
        AuditTarget(0, 2, 2),
        AuditTarget(2, 2, 0),
        AuditTarget(2, 2, 1),
    }
    assert choose_target(2, [0, 0]) is None


def _reducer_result(parts: list[torch.Tensor], weights: list[float], codec: CodecCompression) -> Any:
    """What ``RobustPartReducer`` makes of ``parts`` (one part, every sender), encoded as the
    runner encodes it for everyone."""

    async def scenario() -> torch.Tensor:
        reducer = RobustPartReducer((parts[0].shape,), len(parts), RULE)
        results = await asyncio.gather(
            *(reducer.accumulate_part(i, 0, part, weight=w) for i, (part, w) in enumerate(zip(parts, weights)))
        )
        return results[0]

    return codec.compress_average(asyncio.run(scenario()), DITHER)


DITHER = torch.rand(8192 + 256, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", ["fp16", "int8", "4bit"])
def test_the_re_computation_reproduces_the_reducers_bytes(name: str) -> None:
    codec = CodecCompression(get_codec(name))
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(8192, generator=generator)
    # four senders; one sends 50x (clipped and named), one weighs 1e6 (capped)
    sent = [codec.compress(base + 0.3 * torch.randn(8192, generator=generator), info=None) for _ in range(3)] + [
        codec.compress(50 * torch.randn(8192, generator=generator), info=None)
    ]
    decoded = [codec.decode(part, 8192) for part in sent]
    weights = [10.0, 12.0, 1e6, 11.0]
    returned = _reducer_result(decoded, weights, codec)
    again = codec.compress_average(reduce_like_a_reducer(decoded, weights, RULE), DITHER)
    assert again.buffer == returned.buffer
    assert judge(codec.decode(returned, 8192), codec.decode(again, 8192)) == ""


def test_a_reducer_that_dropped_one_sender_matches_the_inputs_less_that_sender() -> None:
    parts = [torch.randn(512, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    weights = [1.0, 1.0, 1.0, 1.0]
    without = reduce_like_a_reducer(parts, weights, RULE, leave_out=2)
    assert without is not None
    assert torch.equal(without, reduce_like_a_reducer([parts[0], parts[1], parts[3]], [1.0, 1.0, 1.0], RULE))
    assert reduce_like_a_reducer([None, None], [1.0, 1.0], RULE) is None


def test_a_shifted_average_is_wrong_and_a_few_flipped_roundings_are_not() -> None:
    codec = CodecCompression(get_codec("4bit"))
    mean = torch.randn(8192, generator=torch.Generator().manual_seed(3))
    honest = codec.decode(codec.compress_average(mean, DITHER), 8192)
    shifted = codec.decode(codec.compress_average(mean + 0.1 * mean.abs().mean(), DITHER), 8192)
    why = judge(shifted, honest)
    assert "values differ from the re-computation" in why
    flipped = honest.clone()
    flipped[:MIN_FLIPS] += 0.01  # a few roundings another CPU made the other way
    assert judge(flipped, honest) == ""
    huge = honest.clone()
    huge[:3] = 1e4  # few values, far off: the distance names it
    assert "relative L2 distance" in judge(huge, honest)
    assert "non-finite" in judge(torch.full_like(honest, float("nan")), honest)
    assert "values" in judge(honest[:100], honest)


def test_sent_parts_spilled_to_disk_come_back_as_sent(tmp_path: Path) -> None:
    codec = CodecCompression(get_codec("fp16"))
    parts = {(r, p): codec.compress(torch.randn(100 + r + p), info=None) for r in range(3) for p in range(2)}
    spilled, held = SentParts(tmp_path), SentParts()
    for (reducer, part), encoded in parts.items():
        spilled.keep(reducer, part, encoded, 2.0 + reducer)
        held.keep(reducer, part, encoded, 2.0 + reducer)
    assert list(tmp_path.iterdir()) == []  # an unnamed file: nothing left behind, whatever happens
    for (reducer, part), encoded in parts.items():
        got = spilled.get(reducer, part)
        assert got is not None and held.get(reducer, part) == (encoded, 2.0 + reducer)
        assert got[0].SerializeToString() == encoded.SerializeToString() and got[1] == 2.0 + reducer
    assert spilled.get(3, 0) is None and held.get(3, 0) is None


@dataclass
class _Context:
    remote_id: PeerID


class _Runner:
    """What the handlers read of a fragment's runner: the parts this peer sent."""

    def __init__(self) -> None:
        self.sent = SentParts()
        self.sent.keep(1, 0, CodecCompression(get_codec("fp16")).compress(torch.ones(8), info=None), 3.0)
        self.failed_reducers: dict[PeerID, str] = {}
        self.held: set[PeerID] = set()
        """Reducers whose every averaged part this peer holds."""

    def holds_average_of(self, peer_id: PeerID) -> bool:
        return peer_id in self.held and peer_id not in self.failed_reducers


class _Peer(AuditMixin):
    serializer = MSGPackSerializer

    def __init__(self, members: list[PeerID]) -> None:
        self.peer_id = members[0]
        self.room = self._open_audit_room(b"group", [b"group", b"group/fragment/1"], members, frozenset())
        self.room.runners.extend([_Runner(), _Runner()])  # type: ignore[list-item]


def _ids(count: int) -> list[PeerID]:
    return [PeerID(os.urandom(34)) for _ in range(count)]


def _ask(peer: _Peer, who: PeerID, group: bytes, payload: Any, raw: bytes | None = None) -> averaging_pb2.AveragingData:
    request = averaging_pb2.AveragingData(
        group_id=group, peer_id=raw if raw is not None else MSGPackSerializer.dumps(payload)
    )
    return asyncio.run(peer.rpc_audit_part(request, _Context(who)))  # type: ignore[arg-type]


def test_a_member_gets_the_part_as_sent_and_a_stranger_gets_nothing() -> None:
    members = _ids(3)
    peer = _Peer(members)
    reply = _ask(peer, members[1], b"group/fragment/1", [1, 0])
    assert reply.code == averaging_pb2.PART_FOR_AVERAGING and reply.weight == 3.0 and reply.tensor_part.buffer
    assert reply.peer_id == UNSERVED  # its reducer's average is still on its way: not served yet
    peer.room.runners[1].held.add(members[1])  # type: ignore[attr-defined]
    assert _ask(peer, members[1], b"group/fragment/1", [1, 0]).peer_id == b""  # served
    peer.room.runners[1].failed_reducers[members[1]] = "TimeoutError"  # type: ignore[attr-defined]
    assert _ask(peer, members[1], b"group/fragment/1", [1, 0]).peer_id == UNSERVED
    stranger = _ids(1)[0]
    assert _ask(peer, stranger, b"group", [1, 0]).code == averaging_pb2.PROTOCOL_VIOLATION
    assert _ask(peer, members[1], b"another group", [1, 0]).code == averaging_pb2.BAD_GROUP_ID


@pytest.mark.parametrize(
    "payload",
    [[1], [1, 0, 0], ["1", 0], [-1, 0], [2**40, 0], [1.0, 0], {"reducer": 1}, [True, 0], [1, 5]],
)
def test_malformed_part_requests_are_refused(payload: Any) -> None:
    members = _ids(3)
    peer = _Peer(members)
    assert _ask(peer, members[1], b"group", payload).code == averaging_pb2.PROTOCOL_VIOLATION


def test_unreadable_and_oversized_requests_are_refused() -> None:
    members = _ids(3)
    peer = _Peer(members)
    assert _ask(peer, members[1], b"group", None, raw=b"\xc1garbage").code == averaging_pb2.PROTOCOL_VIOLATION
    assert _ask(peer, members[1], b"group", None, raw=b"\x92" + b"\x01" * 4096).code == averaging_pb2.PROTOCOL_VIOLATION


def test_a_member_asking_for_more_than_audits_need_is_refused() -> None:
    members = _ids(3)
    peer = _Peer(members)
    quota = peer.room.quota()
    codes = [_ask(peer, members[2], b"group", [1, 0]).code for _ in range(quota + 5)]
    assert codes[:quota] == [averaging_pb2.PART_FOR_AVERAGING] * quota
    assert set(codes[quota:]) == {averaging_pb2.PROTOCOL_VIOLATION}
    assert _ask(peer, members[1], b"group", [1, 0]).code == averaging_pb2.PART_FOR_AVERAGING  # others unaffected


def _tell(peer: _Peer, who: PeerID, payload: Any) -> averaging_pb2.AveragingData:
    request = averaging_pb2.AveragingData(group_id=b"group", peer_id=MSGPackSerializer.dumps(payload))
    return asyncio.run(peer.rpc_audit_verdict(request, _Context(who)))  # type: ignore[arg-type]


def test_verdicts_first_one_counts_and_accusations_must_name_a_reducer_by_its_index() -> None:
    members = _ids(4)
    peer = _Peer(members)
    room: AuditRoom = peer.room
    assert _tell(peer, _ids(1)[0], ["", 0, 0, 0]).code == averaging_pb2.PROTOCOL_VIOLATION  # a stranger
    assert not room.verdicts
    # an accusation whose index is not the accused's, of a fragment that does not exist, malformed
    for bad in ([str(members[2]), 0, 3, 0], [str(members[2]), 7, 2, 0], [str(members[2]), 0, 2], [5, 0, 0, 0]):
        assert _tell(peer, members[1], bad).code == averaging_pb2.PROTOCOL_VIOLATION, bad
    assert not room.verdicts
    assert _tell(peer, members[1], [str(members[2]), 1, 2, 0]).code == averaging_pb2.NO_CODE
    assert _tell(peer, members[1], ["", 0, 0, 0]).code == averaging_pb2.NO_CODE  # a second verdict: ignored
    verdict = room.verdicts[members[1]]
    assert verdict.accused == str(members[2]) and verdict.target == AuditTarget(1, 2, 0)


def test_a_new_group_drops_the_last_groups_parts() -> None:
    members = _ids(3)
    peer = _Peer(members)
    peer._open_audit_room(b"next", [b"next"], members, frozenset())
    assert _ask(peer, members[1], b"group", [1, 0]).code == averaging_pb2.BAD_GROUP_ID


def test_a_caught_reducer_is_never_admitted_again() -> None:
    class Gated:
        async def _admitted(self, peer: PeerID, *, stale_ok: bool = False) -> bool:
            return True

    class Peer(AuditMixin, Gated):
        pass

    members = _ids(2)
    peer = Peer()
    peer.distrusted.add(str(members[1]))
    assert asyncio.run(peer._admitted(members[0])) and not asyncio.run(peer._admitted(members[1]))


def test_rotation_over_many_groups_spreads_audits() -> None:
    pairs = {
        (member, auditee(os.urandom(20), member, range(5))) for member, _ in itertools.product(range(5), range(200))
    }
    assert len(pairs) == 5 * 4  # every member audits every other reducer over time


class _RecheckRunner:
    """A fragment of four senders whose reducer (index 2) averaged its range's single part."""

    def __init__(self, members: list[PeerID], numel: int) -> None:
        self.ordered_peer_ids = self.sender_peer_ids = members
        self.modes = [AveragingMode.NODE] * len(members)
        self.codec = CodecCompression(get_codec("fp16"))
        vector = torch.zeros(numel * len(members))
        self.tensor_part_container = InPlaceOutputs([vector], [1.0] * len(members), part_size_bytes=4 * numel)
        self.failed_reducers: dict[PeerID, str] = {}
        self.sent = None
        self.numel = numel

    def expected_numel(self, peer_index: int, part_index: int) -> int:
        return self.numel

    def dither(self) -> torch.Tensor:
        return DITHER


class _Auditor(AuditMixin):
    serializer = MSGPackSerializer
    robust = RULE
    client_mode = False

    def __init__(self, members: list[PeerID], runner: _RecheckRunner, served: list[tuple[Any, float, bool]]) -> None:
        self.peer_id = members[0]
        self.room = self._open_audit_room(b"group", [b"group"], members, frozenset())
        self.room.runners.append(runner)  # type: ignore[arg-type]
        self.served = served

    async def _fetch_part(self, runner: Any, sender: PeerID, target: AuditTarget, deadline: float) -> Any:
        return self.served[self.room.peer_ids.index(sender)]


def _reducer_without_late_senders(
    *, seed: int, lying: bool
) -> tuple[list[PeerID], _RecheckRunner, list[Any], list[float]]:
    """Four members; reducer 2's result for its part 0 (in the runner's vector) averages the
    senders' parts less senders 1 and 3, whose parts came too late, shifted if ``lying``; the
    members, the runner, the parts as encoded and their weights."""
    members, numel = _ids(4), 512
    runner = _RecheckRunner(members, numel)
    parts = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + i)) for i in range(4)]
    weights = [1.0, 2.0, 1.0, 3.0]
    encoded = [runner.codec.compress(part, info=None) for part in parts]
    received = [runner.codec.decode(part, numel) for part in encoded]  # what the reducer averages
    averaged = reduce_like_a_reducer(received, weights, RULE, leave_out={1, 3})
    assert averaged is not None
    if lying:
        averaged = averaged + 0.5 * averaged.abs().mean()
    returned = runner.codec.decode(runner.codec.compress_average(averaged, DITHER), numel)
    lo, hi = runner.tensor_part_container.part_range(2, 0)
    runner.tensor_part_container.output[lo:hi] = returned
    return members, runner, encoded, weights


@pytest.mark.parametrize("lying", [False, True])
def test_a_reducer_that_gave_up_on_late_senders_is_honest_and_a_liar_is_still_caught(lying: bool) -> None:
    """A reducer on a slow link averages the parts that came in time and serves the late senders
    no average (``Reducer: received 50.0% of input tensors``): the senders say so with their
    parts, and its result, the average of the others, is honest. Before, every auditor took it
    for a liar ("5632 of 5632 values differ") and left it out of the run for good."""
    members, runner, encoded, weights = _reducer_without_late_senders(seed=10, lying=lying)
    target = AuditTarget(0, 2, 0)

    def recheck(unserved: set[int]) -> str | None:
        served = [(encoded[i], weights[i], i in unserved) for i in range(4)]
        auditor = _Auditor(members, runner, served)
        from engine.auditing import AuditOutcome

        return asyncio.run(auditor._recheck(auditor.room, target, deadline=1e18, outcome=AuditOutcome()))

    if lying:
        assert "values differ" in (recheck({1, 3}) or "")  # the unserved senders' word does not cover a lie
    else:
        assert recheck({1, 3}) == ""
        assert "values differ" in (recheck(set()) or "")  # what every auditor concluded before the senders said it


@pytest.mark.parametrize("lying", [False, True])
def test_a_busy_reducer_that_used_a_late_average_senders_part_is_honest_and_a_liar_is_still_caught(
    lying: bool,
) -> None:
    """Not served is not always dropped: a busy reducer (the churn lab, 12 peers on 2 cores)
    gave up on senders 1 and 3, whose parts came late, and its average reached sender 0 after
    sender 0's own timeout, so sender 0 says it was served none too, although the reducer used
    its part. Its result, the average of senders 0 and 2, is honest; every auditor took it for a
    liar before ("704 of 2816 values differ") and left it out of the run for good."""
    members, runner, encoded, weights = _reducer_without_late_senders(seed=20, lying=lying)
    served = [(encoded[i], weights[i], i in {0, 1, 3}) for i in range(4)]
    auditor = _Auditor(members, runner, served)
    from engine.auditing import AuditOutcome

    found = asyncio.run(auditor._recheck(auditor.room, AuditTarget(0, 2, 0), deadline=1e18, outcome=AuditOutcome()))
    assert ("values differ" in (found or "")) if lying else found == ""
    # out of time before every candidate was tried: inconclusive, never a conviction
    late = asyncio.run(auditor._recheck(auditor.room, AuditTarget(0, 2, 0), deadline=0.0, outcome=AuditOutcome()))
    assert late is None


def test_the_left_out_candidates_are_every_subset_of_the_unserved_once_likeliest_first() -> None:
    from engine.audit import MAX_LEFT_OUT_SETS, leave_out_candidates

    def sets(found: list[int | frozenset[int] | None]) -> list[frozenset[int]]:
        return [frozenset() if c is None else frozenset({c}) if isinstance(c, int) else c for c in found]

    found = leave_out_candidates(8, {1, 3, 5, 6})
    assert found[:3] == [None, frozenset({1, 3, 5, 6}), frozenset({3, 5, 6})]
    assert len(sets(found)) == len(set(sets(found)))  # each once
    subsets = {frozenset(s) for size in range(5) for s in itertools.combinations([1, 3, 5, 6], size)}
    assert subsets <= set(sets(found)) and {frozenset({i}) for i in range(8)} <= set(sets(found))
    six = leave_out_candidates(12, set(range(6)))  # every subset of six still fits
    assert {frozenset(s) for size in range(7) for s in itertools.combinations(range(6), size)} <= set(sets(six))
    many = leave_out_candidates(12, set(range(11)))  # beyond: the likeliest, pairs among them
    many_sets = sets(many)
    assert len(many_sets) == len(set(many_sets)) and len(many) <= 1 + MAX_LEFT_OUT_SETS + 12
    assert frozenset(range(11)) in many_sets and frozenset({0, 1}) in many_sets
    assert frozenset(range(2, 11)) in many_sets  # all but two
    assert leave_out_candidates(3, set()) == [None, 0, 1, 2]


def test_the_left_out_candidates_of_a_round_where_half_a_big_group_went_unserved_are_few_and_quick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40 of 64 senders unserved (a round that failed for many): the subsets are drawn only
    while the budget lasts. Before, every one of C(40, k) subsets up to k = 20 was walked after
    the budget was spent (~10^11): the auditing averager's thread held the GIL for minutes and
    its member stopped answering (seen in a 64-member round)."""
    import engine.audit
    from engine.audit import MAX_LEFT_OUT_SETS, leave_out_candidates

    drawn = [0]
    combinations = itertools.combinations

    def counting(pool: Any, r: int) -> Any:
        for subset in combinations(pool, r):
            drawn[0] += 1
            yield subset

    monkeypatch.setattr(engine.audit.itertools, "combinations", counting)
    found = leave_out_candidates(64, set(range(40)))
    assert len(found) <= 1 + MAX_LEFT_OUT_SETS + 64
    assert drawn[0] <= MAX_LEFT_OUT_SETS + 1
