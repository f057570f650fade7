"""Which members of a group started the round from another state than its majority."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from engine.allreduce import RoundFailedError, stale_members
from engine.outcome import AllReduceStats
from peer.round.swarm_port import RoundResult
from protocol.gathered import Gathered

PEERS = [PeerID(f"peer{i}".encode()) for i in range(4)]


def group(*gathers: object) -> GroupInfo:
    gathered = tuple(
        g if isinstance(g, bytes) else MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(g)]) for g in gathers
    )
    return GroupInfo(b"group", tuple(PEERS[: len(gathers)]), gathered)


def d(digest: object, round_: object = 4) -> dict[str, object]:
    return {"round": round_, "digest": digest}


def test_the_minority_is_stale() -> None:
    assert stale_members(group(d("a"), d("a"), d("b")), MSGPackSerializer) == {PEERS[2]}


def test_a_tie_fails_the_round_for_everyone() -> None:
    with pytest.raises(RoundFailedError, match="no strict majority"):
        stale_members(group(d("a"), d("b")), MSGPackSerializer)
    with pytest.raises(RoundFailedError):
        stale_members(group(d("a"), d("a"), d("b"), d("b")), MSGPackSerializer)


def test_in_a_two_member_group_the_one_behind_is_stale() -> None:
    assert stale_members(group(d("old", 3), d("new", 4)), MSGPackSerializer) == {PEERS[0]}
    # however many are behind: they did not average the round the newest ones did
    assert stale_members(group(d("x", 3), d("x", 3), d("new", 4)), MSGPackSerializer) == {PEERS[0], PEERS[1]}


def test_members_without_a_readable_state_cast_no_vote_and_count_zero() -> None:
    g = group(d("a"), d("a"), None, b"\xc1garbage")
    assert stale_members(g, MSGPackSerializer) == {PEERS[2], PEERS[3]}
    g = group(d("a"), d("a"), d(7), d("a", -1))
    assert stale_members(g, MSGPackSerializer) == {PEERS[2], PEERS[3]}


def test_groups_that_gather_no_state_have_no_stale_member() -> None:
    assert stale_members(group(None, {"x": 1}, {}), MSGPackSerializer) == frozenset()


def _result(*states: object) -> RoundResult:
    members = [Gathered.parse(s if isinstance(s, dict) else d(s)) or Gathered() for s in states]
    return RoundResult(
        averaged=torch.zeros(1), group_size=len(members), members=members, stats=AllReduceStats(), wait_s=0.0
    )


def test_a_peer_knows_whether_it_started_in_sync_with_its_group() -> None:
    assert _result("a", "a", "b").started_in_sync(4, "a")
    assert not _result("a", "a", "b").started_in_sync(4, "b")
    # a tie: neither side can tell which state is the swarm's, both re-check
    assert not _result("a", "b").started_in_sync(4, "a")
    assert not _result("a", "b").started_in_sync(4, "b")
    assert not _result(d("old", 3), d("new", 4)).started_in_sync(3, "old")
    assert _result(d("old", 3), d("new", 4)).started_in_sync(4, "new")
    assert _result({}, {"x": 1}).started_in_sync(4, "a")  # nobody said: nothing to compare
