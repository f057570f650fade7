"""The round's start message in O(N) bytes from its leader: a digest, and a member to fetch the
group from.

Every member of a group needs the whole group to start its all-reduce: the members in the
all-reduce's order and what each gathered (``protocol.gathered``, ~180 bytes each). hivemind's
leader sends all of it to every follower, N − 1 copies of N entries: N² bytes from one uplink
(2.9 MB at 128 members, ~14 MB at 256). Here the leader sends the whole group to at most
``FANOUT`` followers; every other follower gets the group's id, its SHA-256 digest and a parent,
a member that holds the group and serves it (``rpc_group_start``), checked against the digest
on arrival. The parents form a tree of fan-out ``FANOUT`` rooted at the leader (depth 2 up to
272 members, 3 up to 4,368), so no member sends more than ``FANOUT`` + 1 copies of the group
whatever N is: O(N) bytes each.

Trust is as before: the leader could always send any group, and its digest now binds what a
parent may serve. A parent that serves another group, serves nothing or is gone costs its
children one fetch from the leader instead, asked after ``HEDGE_S`` at most. Only the group's members get the group from anyone
(they hold it already); a member that cannot be dialled (a client) is never a parent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hivemind.proto import averaging_pb2

__all__ = [
    "DIGEST_BYTES",
    "FANOUT",
    "FETCH_S",
    "HEDGE_S",
    "MARK",
    "StartPlan",
    "compact_start",
    "group_digest",
    "parse_compact",
    "plan_start",
    "valid_start",
]

FANOUT = 16
"""Followers the leader sends the whole group to, and children each of them serves it to."""
FETCH_S = 5.0
"""How long a follower's call for the group waits for an answer, and how long a member asked for
a group it does not hold yet waits for it."""
HEDGE_S = 1.0
"""How long a follower waits for its parent before it asks the leader as well."""
MARK = b"swarmtrain/group-digest/1:"
"""Prefix of the one gathered entry of a compact start message. A real entry is msgpack
``[bandwidth, mode, user bytes]`` and starts with the byte 0x93."""
DIGEST_BYTES = 32


def group_digest(group_id: bytes, peer_ids: Sequence[bytes], gathered: Sequence[bytes]) -> bytes:
    """SHA-256 over the group: its id, then each member and its gathered bytes, length-prefixed
    (no two groups share an encoding)."""
    digest = hashlib.sha256()
    for field in (group_id, *peer_ids, *gathered):
        digest.update(len(field).to_bytes(8, "big"))
        digest.update(field)
    digest.update(len(peer_ids).to_bytes(8, "big"))
    return digest.digest()


def compact_start(group_id: bytes, digest: bytes, parent: bytes) -> averaging_pb2.MessageFromLeader:
    """The start message of a follower that fetches the group from ``parent``."""
    return averaging_pb2.MessageFromLeader(
        code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group_id, ordered_peer_ids=[parent], gathered=[MARK + digest]
    )


def parse_compact(message: averaging_pb2.MessageFromLeader) -> tuple[bytes, bytes] | None:
    """``(parent, digest)`` of a compact start message; None for a whole one (or anything else)."""
    if len(message.gathered) != 1 or len(message.ordered_peer_ids) != 1:
        return None
    entry = bytes(message.gathered[0])
    if not entry.startswith(MARK) or len(entry) != len(MARK) + DIGEST_BYTES:
        return None
    return bytes(message.ordered_peer_ids[0]), entry[len(MARK) :]


def valid_start(message: averaging_pb2.MessageFromLeader, group_id: bytes, digest: bytes, member: bytes) -> bool:
    """Whether ``message`` (a parent's answer: untrusted) is the whole group ``group_id`` whose
    digest the leader sent, with ``member`` in it."""
    peers = [bytes(peer) for peer in message.ordered_peer_ids]
    gathered = [bytes(data) for data in message.gathered]
    return (
        message.code == averaging_pb2.BEGIN_ALLREDUCE
        and bytes(message.group_id) == group_id
        and len(peers) == len(gathered)
        and member in peers
        and group_digest(group_id, peers, gathered) == digest
    )


@dataclass(frozen=True)
class StartPlan:
    """Who a leader sends the whole group to, and where each other follower fetches it."""

    group_id: bytes
    digest: bytes
    peers: tuple[bytes, ...]
    """The members, in the all-reduce's order."""
    parents: dict[bytes, bytes]
    """Follower → the member it fetches the group from (followers not in it get the whole group)."""
    whole_bytes: int
    """Bytes of one whole start message."""

    def message_for(self, follower: bytes, whole: averaging_pb2.MessageFromLeader) -> averaging_pb2.MessageFromLeader:
        """What the leader sends ``follower``: ``whole``, or the compact message to its parent."""
        parent = self.parents.get(follower)
        return whole if parent is None else compact_start(self.group_id, self.digest, parent)

    def leader_bytes(self, followers: int) -> int:
        """Bytes the leader sends to start a group of ``followers`` followers."""
        compact = compact_start(self.group_id, self.digest, b"\0" * 38).ByteSize()
        return (followers - len(self.parents)) * self.whole_bytes + len(self.parents) * compact


def plan_start(
    group_id: bytes,
    leader: bytes,
    peer_ids: Sequence[bytes],
    gathered: Sequence[bytes],
    can_serve: Callable[[bytes], bool],
    fanout: int = FANOUT,
) -> StartPlan:
    """The tree for a group the leader ``leader`` assembled (``peer_ids`` in the all-reduce's
    order, ``gathered`` alike): the leader first, then the followers that can be dialled
    (``can_serve``), then the others, in the group's order; the member at place ``i`` ≥ 1
    fetches from the one at place ``(i - 1) // fanout``, or gets the whole group from the
    leader where that is the leader or a member that cannot be dialled."""
    if fanout < 1:
        raise ValueError(f"fanout must be at least 1, not {fanout}")
    followers = [peer for peer in peer_ids if peer != leader]
    places = [leader] + [p for p in followers if can_serve(p)] + [p for p in followers if not can_serve(p)]
    parents = {}
    for index in range(1, len(places)):
        parent = places[(index - 1) // fanout]
        if parent != leader and can_serve(parent):
            parents[places[index]] = parent
    whole = averaging_pb2.MessageFromLeader(
        code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group_id, ordered_peer_ids=list(peer_ids), gathered=list(gathered)
    )
    digest = group_digest(group_id, peer_ids, gathered)
    return StartPlan(group_id, digest, tuple(peer_ids), parents, whole.ByteSize())
