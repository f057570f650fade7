"""The round's start in O(N) bytes from its leader (``engine.start_tree``), with real averagers
on a real hivemind DHT: five members with a fan-out of 1, so that the group travels down a chain
(the leader → one follower → the next → ...), each member fetching it from its parent.

- The honest chain: every member averages the same group; the leader sent the whole group once.
- A hostile parent: every member that is not the leader serves a reordered group (its reducers
  reassigned). Each child sees the leader's digest fail, fetches from the leader instead, and
  the round is the honest one for all five.
- A silent parent: every member that is not the leader never answers; each child asks the
  leader after a second, and the round is the honest one for all five.
- A stranger asking a member for the group after the round is refused; a member asking gets it.
- A stranger asking a gated run's averager for any group is refused before anything is read.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.outcome import GroupOutcome
from engine.start_tree import DIGEST_BYTES, compact_start
from protocol.identity import Identity
from protocol.membership import MemberGate

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MEMBERS = 5
NUMEL = 4000
PREFIX = "groupstart"


def _served_log(log: Path) -> Any:
    """An ``rpc_group_start`` that also writes each group id it was asked for to ``log``. (hivemind
    reads a handler's message types from its annotations.)"""

    async def rpc_group_start(
        self: ExactAverager, request: averaging_pb2.MessageFromLeader, context: P2PContext
    ) -> averaging_pb2.MessageFromLeader:
        answer = await ExactAverager.rpc_group_start(self, request, context)
        with log.open("a") as out:
            out.write(bytes(request.group_id).hex() + "\n")
        return answer

    return rpc_group_start


async def _reordering_parent(
    self: ExactAverager, request: averaging_pb2.MessageFromLeader, context: P2PContext
) -> averaging_pb2.MessageFromLeader:
    """A hostile parent: the group it serves, reversed (every reducer's range reassigned), unless
    it led that group."""
    answer = await ExactAverager.rpc_group_start(self, request, context)
    plan = self._matchmaking.__dict__.get("_start_plan")
    if answer.code == averaging_pb2.BEGIN_ALLREDUCE and (plan is None or plan.group_id != bytes(request.group_id)):
        answer = averaging_pb2.MessageFromLeader(
            code=answer.code,
            group_id=answer.group_id,
            ordered_peer_ids=list(reversed(answer.ordered_peer_ids)),
            gathered=list(reversed(answer.gathered)),
        )
    return answer


async def _silent_parent(
    self: ExactAverager, request: averaging_pb2.MessageFromLeader, context: P2PContext
) -> averaging_pb2.MessageFromLeader:
    """A parent that never answers (a member hung, or one holding its children back), unless it
    led the group."""
    plan = self._matchmaking.__dict__.get("_start_plan")
    if plan is None or plan.group_id != bytes(request.group_id):
        await asyncio.sleep(3600)
    return await ExactAverager.rpc_group_start(self, request, context)


def _group(
    handler: Any, gate: MemberGate | None = None, members: int = MEMBERS
) -> tuple[list[DHT], list[ExactAverager]]:
    # hivemind names RPC handlers after the class: each must look like an ExactAverager
    cls = type("ExactAverager", (ExactAverager,), {"rpc_group_start": handler})
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [
        DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in range(members - 1)
    ]
    averagers = []
    for i, dht in enumerate(dhts):
        averager = cls(
            NUMEL,
            dht,
            codec=get_codec("none"),
            prefix=PREFIX,
            start=True,
            min_group_size=members,
            target_group_size=members,
            min_matchmaking_time=4.0,
            request_timeout=3.0,
            allreduce_timeout=30.0,
            gate=gate,
            start_fanout=1,
        )
        with averager.get_tensors() as tensors:
            tensors[0].fill_(float(i + 1))
        averagers.append(averager)
    return dhts, averagers


@pytest.fixture
def shut() -> Iterator[list[Any]]:
    """Averagers and DHT nodes to shut down after the test, in that order."""
    made: list[Any] = []
    yield made
    for thing in made:
        thing.shutdown()


def _one_round(averagers: list[ExactAverager]) -> dict[int, GroupOutcome]:
    outcomes: dict[int, GroupOutcome] = {}

    def step(i: int) -> None:
        outcomes[i] = averagers[i].step(weight=1.0, timeout=40, allow_retries=False)

    threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return outcomes


def _averaged(averagers: list[ExactAverager]) -> list[torch.Tensor]:
    vectors = []
    for averager in averagers:
        with averager.get_tensors() as tensors:
            vectors.append(tensors[0].clone())
    return vectors


async def _ask_for_group(_dht: Any, node: Any, *, member: PeerID, group_id: bytes) -> bytes:
    """In a DHT node's process: its ``rpc_group_start`` call to ``member``, as sent back."""
    stub = ExactAverager.get_stub(node.p2p, member, namespace=PREFIX)
    answer = await stub.rpc_group_start(averaging_pb2.MessageFromLeader(group_id=group_id), timeout=10)
    return bytes(answer.SerializeToString())


def test_the_group_travels_down_the_tree_and_only_its_members_may_read_it(tmp_path: Path, shut: list[Any]) -> None:
    log = tmp_path / "served"
    dhts, averagers = _group(_served_log(log))
    shut += averagers + dhts
    outcomes = _one_round(averagers)
    assert set(outcomes) == set(range(MEMBERS)), outcomes
    assert all(not o.failed and len(o.gathered) == MEMBERS for o in outcomes.values()), outcomes
    for vector in _averaged(averagers):
        assert torch.equal(vector, torch.full((NUMEL,), 3.0))  # (1 + 2 + 3 + 4 + 5) / 5
    (leader,) = [i for i, o in outcomes.items() if o.led is not None]
    led = outcomes[leader].led
    assert led is not None and led["begin_whole"] == 1, led  # one follower got the whole group
    # down the chain: three followers served the group once each, the last one served nobody
    served = sorted(o.stats.start_bytes for i, o in outcomes.items() if i != leader)
    whole = served[-1]
    assert served == [0, whole, whole, whole] and whole > 0, served
    (group_hex,) = set(log.read_text().split())
    group_id = bytes.fromhex(group_hex)
    # the leader: the whole group once, a digest and a parent to each of the other three
    compact = compact_start(group_id, b"\0" * DIGEST_BYTES, dhts[0].peer_id.to_bytes()).ByteSize()
    assert outcomes[leader].stats.start_bytes == led["begin_bytes"] == whole + 3 * compact, (led, whole, compact)
    member, other = dhts[0].peer_id, dhts[1]
    stranger = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=dhts[0].get_visible_maddrs())
    shut.append(stranger)
    refused = averaging_pb2.MessageFromLeader.FromString(
        stranger.run_coroutine(partial(_ask_for_group, member=member, group_id=group_id))
    )
    assert refused.code == averaging_pb2.NOT_LOOKING_FOR_GROUP and not refused.ordered_peer_ids, refused
    served_to_member = averaging_pb2.MessageFromLeader.FromString(
        other.run_coroutine(partial(_ask_for_group, member=member, group_id=group_id))
    )
    assert served_to_member.code == averaging_pb2.BEGIN_ALLREDUCE
    assert len(served_to_member.ordered_peer_ids) == MEMBERS


def test_a_parent_that_serves_another_group_costs_its_child_one_fetch_from_the_leader(shut: list[Any]) -> None:
    dhts, averagers = _group(_reordering_parent)
    shut += averagers + dhts
    outcomes = _one_round(averagers)
    assert set(outcomes) == set(range(MEMBERS)), outcomes
    assert all(not o.failed and len(o.gathered) == MEMBERS for o in outcomes.values()), outcomes
    orders = {tuple(o.stats.peer_ids) for o in outcomes.values()}
    assert len(orders) == 1, orders  # every member runs the leader's order, none the reversed one
    for vector in _averaged(averagers):
        assert torch.equal(vector, torch.full((NUMEL,), 3.0))
    (leader,) = [i for i, o in outcomes.items() if o.led is not None]
    led = outcomes[leader].led
    assert led is not None
    # the three children of hostile parents fetched the whole group from the leader
    whole_bytes = (outcomes[leader].stats.start_bytes - led["begin_bytes"]) / 3
    assert whole_bytes > 0 and float(whole_bytes).is_integer(), (outcomes[leader].stats.start_bytes, led)


def test_a_parent_that_never_answers_costs_its_child_one_fetch_from_the_leader(shut: list[Any]) -> None:
    dhts, averagers = _group(_silent_parent)
    shut += averagers + dhts
    outcomes = _one_round(averagers)
    assert set(outcomes) == set(range(MEMBERS)), outcomes
    assert all(not o.failed and len(o.gathered) == MEMBERS for o in outcomes.values()), outcomes
    for vector in _averaged(averagers):
        assert torch.equal(vector, torch.full((NUMEL,), 3.0))
    (leader,) = [i for i, o in outcomes.items() if o.led is not None]
    led = outcomes[leader].led
    assert led is not None and outcomes[leader].stats.start_bytes > led["begin_bytes"]  # it served the children


def test_a_stranger_gets_no_group_from_a_gated_run(shut: list[Any]) -> None:
    gate = MemberGate(coordinator_key=Identity.generate().public_key, run_digest="groupstart", prefix=PREFIX)
    dhts, averagers = _group(ExactAverager.rpc_group_start, gate=gate, members=1)
    shut += averagers + dhts
    stranger = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=dhts[0].get_visible_maddrs())
    shut.append(stranger)
    answer = averaging_pb2.MessageFromLeader.FromString(
        stranger.run_coroutine(partial(_ask_for_group, member=dhts[0].peer_id, group_id=b"\1" * 20))
    )
    assert answer.code == averaging_pb2.PROTOCOL_VIOLATION and not answer.ordered_peer_ids, answer
