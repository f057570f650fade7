"""Which members of a group started the round from another state than its majority."""

from __future__ import annotations

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from peer.swarm import RoundResult
from protocol.averaging import stale_members

PEERS = [PeerID(f"peer{i}".encode()) for i in range(4)]


def group(*gathers: object) -> GroupInfo:
    gathered = tuple(
        g if isinstance(g, bytes) else MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(g)]) for g in gathers
    )
    return GroupInfo(b"group", tuple(PEERS[: len(gathers)]), gathered)


def test_the_minority_is_stale() -> None:
    assert stale_members(group({"digest": "a"}, {"digest": "a"}, {"digest": "b"}), MSGPackSerializer) == {PEERS[2]}


def test_no_strict_majority_no_one_is_stale() -> None:
    assert stale_members(group({"digest": "a"}, {"digest": "b"}), MSGPackSerializer) == frozenset()
    assert stale_members(group({"digest": "a"}, {"digest": "a"}, {"digest": "b"}, {"digest": "b"}),
                         MSGPackSerializer) == frozenset()


def test_members_without_a_readable_digest_count_against_the_majority() -> None:
    g = group({"digest": "a"}, {"digest": "a"}, None, b"\xc1garbage")
    assert stale_members(g, MSGPackSerializer) == frozenset()  # 2 of 4 is no strict majority
    g = group({"digest": "a"}, {"digest": "a"}, {"digest": 7})
    assert stale_members(g, MSGPackSerializer) == {PEERS[2]}


def test_groups_that_gather_no_digest_have_no_stale_member() -> None:
    assert stale_members(group(None, {"x": 1}, {}), MSGPackSerializer) == frozenset()


def _result(*digests: object) -> RoundResult:
    members = [{"digest": d} for d in digests]
    return RoundResult(averaged=torch.zeros(1), group_size=len(members), members=members, bytes_sent=0,
                       bytes_received=0, wait_s=0.0)


def test_a_peer_knows_whether_it_started_with_the_majority() -> None:
    assert _result("a", "a", "b").started_with_majority("a")
    assert not _result("a", "a", "b").started_with_majority("b")
    # a tie: neither side can tell which state is the swarm's, both re-check
    assert not _result("a", "b").started_with_majority("a")
    assert not _result("a", "b").started_with_majority("b")
    assert _result(None, None).started_with_majority("a")  # nobody said: nothing to compare
