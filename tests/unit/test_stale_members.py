"""Which members of a group started the round from another state than its majority."""

from __future__ import annotations

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

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
