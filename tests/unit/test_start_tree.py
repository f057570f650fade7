"""The round's start message from its leader in O(N) bytes (``engine.start_tree``)."""

from __future__ import annotations

import os

import pytest
from hivemind.proto import averaging_pb2

from engine.start_tree import (
    DIGEST_BYTES,
    FANOUT,
    compact_start,
    group_digest,
    parse_compact,
    plan_start,
    valid_start,
)

GATHER_BYTES = 180
"""About what a peer gathers (``protocol.gathered``)."""


def _group(n: int) -> tuple[bytes, list[bytes], list[bytes]]:
    peers = [b"\x00\x24" + os.urandom(36) for _ in range(n)]
    gathered = [b"\x93" + os.urandom(GATHER_BYTES - 1) for _ in range(n)]
    return os.urandom(20), peers, gathered


def _depth(plan_parents: dict[bytes, bytes], member: bytes) -> int:
    depth = 1
    while member in plan_parents:
        member = plan_parents[member]
        depth += 1
    return depth


@pytest.mark.parametrize("n", [2, 17, 18, 100, 256, 1000])
def test_every_follower_reaches_the_leader_and_nobody_serves_more_than_the_fanout(n: int) -> None:
    group_id, peers, gathered = _group(n)
    leader = peers[n // 2]
    plan = plan_start(group_id, leader, peers, gathered, lambda _: True)
    followers = [p for p in peers if p != leader]
    whole = [p for p in followers if p not in plan.parents]
    assert len(whole) == min(FANOUT, n - 1)
    children: dict[bytes, int] = {}
    for child, parent in plan.parents.items():
        assert parent in peers and parent != child and parent != leader
        children[parent] = children.get(parent, 0) + 1
    assert max(children.values(), default=0) <= FANOUT
    depth = max(_depth(plan.parents, p) for p in followers)
    assert depth <= 3  # 1 + 16 + 256 members at depth ≤ 2, up to 4,368 at depth ≤ 3
    if n <= FANOUT + 1:
        assert not plan.parents  # a small group is started as hivemind starts it


def test_the_leaders_start_grows_linearly_not_as_n_squared() -> None:
    sent = {}
    for n in (64, 128, 256, 512):
        group_id, peers, gathered = _group(n)
        sent[n] = plan_start(group_id, peers[0], peers, gathered, lambda _: True).leader_bytes(n - 1)
    whole_at_256 = 256 * (GATHER_BYTES + 40)
    assert sent[256] < (FANOUT + 1) * whole_at_256  # against 255 whole copies before (~14 MB)
    assert sent[512] / sent[256] == pytest.approx(2.0, rel=0.05)
    assert sent[256] / sent[128] == pytest.approx(2.0, rel=0.05)


def test_a_member_that_cannot_be_dialled_is_never_a_parent() -> None:
    group_id, peers, gathered = _group(60)
    leader = peers[0]
    clients = set(peers[1:50])  # most of the group behind NATs without relays
    plan = plan_start(group_id, leader, peers, gathered, lambda p: p not in clients)
    assert not set(plan.parents.values()) & clients
    # the leader sends the whole group to 16 (the 10 that can be dialled first), and those
    # that can be dialled serve it to the other 43
    assert sum(1 for p in peers[1:] if p not in plan.parents) == FANOUT
    assert len(plan.parents) == 60 - 1 - FANOUT
    assert all(parent in peers[50:] for parent in plan.parents.values())


def test_the_digest_binds_every_field() -> None:
    group_id, peers, gathered = _group(5)
    digest = group_digest(group_id, peers, gathered)
    assert len(digest) == DIGEST_BYTES
    assert group_digest(os.urandom(20), peers, gathered) != digest
    assert group_digest(group_id, peers[::-1], gathered[::-1]) != digest
    assert group_digest(group_id, peers, [gathered[0] + b"x", *gathered[1:]]) != digest
    assert group_digest(group_id, peers[:-1], gathered[:-1]) != digest
    # fields cannot slide into each other: a byte moved from one entry to the next
    moved = [gathered[0][:-1], gathered[0][-1:] + gathered[1], *gathered[2:]]
    assert group_digest(group_id, peers, moved) != digest


def test_a_parents_answer_is_used_only_if_it_is_the_leaders_group_with_the_asker_in_it() -> None:
    group_id, peers, gathered = _group(5)
    digest = group_digest(group_id, peers, gathered)

    def answer(**change: object) -> averaging_pb2.MessageFromLeader:
        fields: dict[str, object] = {
            "code": averaging_pb2.BEGIN_ALLREDUCE,
            "group_id": group_id,
            "ordered_peer_ids": peers,
            "gathered": gathered,
        }
        fields.update(change)
        return averaging_pb2.MessageFromLeader(**fields)  # type: ignore[arg-type]

    assert valid_start(answer(), group_id, digest, peers[3])
    assert not valid_start(answer(), group_id, digest, b"someone else")
    assert not valid_start(answer(code=averaging_pb2.NOT_LOOKING_FOR_GROUP), group_id, digest, peers[3])
    assert not valid_start(answer(ordered_peer_ids=peers[::-1], gathered=gathered[::-1]), group_id, digest, peers[3])
    assert not valid_start(answer(gathered=gathered[:-1]), group_id, digest, peers[3])
    assert not valid_start(answer(group_id=os.urandom(20)), group_id, digest, peers[3])


def test_a_compact_start_is_told_apart_from_a_whole_one() -> None:
    group_id, peers, gathered = _group(2)
    digest = group_digest(group_id, peers, gathered)
    compact = compact_start(group_id, digest, peers[0])
    assert parse_compact(compact) == (peers[0], digest)
    whole = averaging_pb2.MessageFromLeader(
        code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group_id, ordered_peer_ids=peers[:1], gathered=gathered[:1]
    )
    assert parse_compact(whole) is None  # a real gathered entry never starts with the mark
    truncated = averaging_pb2.MessageFromLeader(
        code=averaging_pb2.BEGIN_ALLREDUCE,
        group_id=group_id,
        ordered_peer_ids=[peers[0]],
        gathered=[compact.gathered[0][:-1]],
    )
    assert parse_compact(truncated) is None
    with pytest.raises(ValueError, match="fanout"):
        plan_start(group_id, peers[0], peers, gathered, lambda _: True, fanout=0)
