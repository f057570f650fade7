"""The leader's and each member's side of starting a round in O(N) bytes (``engine.start_tree``):
the leader plans the tree and sends each follower the whole group or a digest and a parent; a
follower sent a digest fetches the group from its parent (or the leader) and checks it; every
member keeps the groups it was in and serves them to their other members
(``rpc_group_start``, ``engine.averager_gate``). Mixed into ``engine.matchmaking.RoundMatchmaking``
(before hivemind's ``Matchmaking``, whose leader and follower steps it wraps)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.start_tree import FANOUT, FETCH_S, HEDGE_S, StartPlan, parse_compact, plan_start, valid_start

__all__ = ["MAX_START_WAITERS", "MAX_WAITS_PER_ASKER", "STARTS_KEPT", "GroupStartMixin"]

logger = logging.getLogger(__name__)

STARTS_KEPT = 4
"""Groups whose start a member keeps to serve to the group's other members (``serve_start``)."""
MAX_START_WAITERS = 4096
"""Calls for a group this member does not hold yet that may wait for it at once."""
MAX_WAITS_PER_ASKER = 2
"""Of those, the calls one peer may have waiting at once: a child asks its parent once a round
(its hedge goes to the leader), so an admitted peer asking for made-up groups holds at most this
many of a member's waits, not all ``MAX_START_WAITERS`` of them."""


class GroupStartMixin:
    """The start of a group in O(N) bytes from its leader; see the module."""

    peer_id: PeerID
    is_looking_for_group: bool
    _servicer_type: Any
    _p2p: Any
    _prefix: str

    async def leader_assemble_group(self) -> Any:
        """hivemind's, then the tree the group's start travels down (``engine.start_tree``)."""
        group = await super().leader_assemble_group()  # type: ignore[misc]
        followers = getattr(self, "current_followers", {})
        peers = [peer.to_bytes() for peer in group.peer_ids]
        dialable = {peer.to_bytes() for peer, request in followers.items() if not request.client_mode}
        plan = plan_start(
            group.group_id, self.peer_id.to_bytes(), peers, group.gathered, dialable.__contains__, self.start_fanout
        )
        self.__dict__["_start_plan"] = plan
        self._keep_start(group.group_id, list(group.peer_ids), group.gathered)
        self._count_start_sent(group.group_id, plan.leader_bytes(len(peers) - 1))
        return group

    def start_summary(self, group_id: bytes) -> dict[str, float]:
        """For a group led here: the bytes this leader sent to start it, how many followers got
        the whole group, and the bytes of one whole start message (hivemind's leader sent one
        to each follower)."""
        plan: StartPlan | None = self.__dict__.get("_start_plan")
        if plan is None or plan.group_id != group_id:
            return {}
        return {
            "begin_bytes": self.start_sent(group_id),
            "begin_whole": len(plan.peers) - 1 - len(plan.parents),
            "whole_bytes": plan.whole_bytes,
        }

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's, with the start message for the tree: the whole group, or a digest and a
        parent."""
        async for message in super().rpc_join_group(request, context):  # type: ignore[misc]
            plan: StartPlan | None = self.__dict__.get("_start_plan")
            if message.code == averaging_pb2.BEGIN_ALLREDUCE and plan is not None and plan.group_id == message.group_id:
                message = plan.message_for(context.remote_id.to_bytes(), message)
            yield message

    @property
    def start_fanout(self) -> int:
        """Followers this leader sends the whole group to, and children each of them serves it
        to (``engine.start_tree.FANOUT``; a test may set fewer to build a deeper tree)."""
        fanout: int = self.__dict__.get("_start_fanout", FANOUT)
        return fanout

    @start_fanout.setter
    def start_fanout(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"start_fanout must be at least 1, not {value}")
        self.__dict__["_start_fanout"] = value

    async def follower_assemble_group(self, leader: PeerID, msg: averaging_pb2.MessageFromLeader) -> Any:
        """hivemind's, from the whole group: the leader's message, or, where the leader sent a
        digest and a parent (``engine.start_tree``), the group fetched from the parent (or from
        the leader, where the parent does not serve it) and checked against the digest."""
        compact = parse_compact(msg)
        if compact is not None:
            parent, digest = compact
            msg = await self._fetch_start(leader, bytes(msg.group_id), PeerID(parent), digest)
        group = await super().follower_assemble_group(leader, msg)  # type: ignore[misc]
        self._keep_start(group.group_id, list(group.peer_ids), group.gathered)
        return group

    async def _fetch_start(
        self, leader: PeerID, group_id: bytes, parent: PeerID, digest: bytes
    ) -> averaging_pb2.MessageFromLeader:
        """The whole group ``group_id`` whose digest is ``digest``: from ``parent``, and from
        ``leader`` too once the parent has not served it within ``HEDGE_S`` (a first round's new
        connection on a loaded host, a dead or silent parent) or served another group; the first
        valid answer wins. A call still under way is left to end on its own timeout, never
        cancelled (a cancelled dial puts p2pd into dial backoff towards that member, and the
        all-reduce needs it). ``TimeoutError`` if no answer is valid within ``FETCH_S`` of the
        last ask (hivemind then counts the leader's answer as lost: this peer misses the round,
        as if the leader's message had)."""
        me = self.peer_id.to_bytes()
        calls: set[asyncio.Task[averaging_pb2.MessageFromLeader | None]] = self.__dict__.setdefault(
            "_start_calls", set()
        )

        async def ask(source: PeerID) -> averaging_pb2.MessageFromLeader | None:
            try:
                stub = self._servicer_type.get_stub(self._p2p, source, namespace=self._prefix)
                answer = await stub.rpc_group_start(averaging_pb2.MessageFromLeader(group_id=group_id), timeout=FETCH_S)
            except Exception as exc:  # noqa: BLE001 - a dead, slow or hostile member: the next one
                logger.warning("could not fetch the group's start from %s: %r", source, exc)
                return None
            if valid_start(answer, group_id, digest, me):
                return answer
            logger.warning("%s served another group than its leader's digest names: not used", source)
            return None

        asked: list[asyncio.Task[averaging_pb2.MessageFromLeader | None]] = []
        sources = [source for source in dict.fromkeys((parent, leader)) if source != self.peer_id]
        for number, source in enumerate(sources):
            task = asyncio.ensure_future(ask(source))
            calls.add(task)
            task.add_done_callback(calls.discard)
            asked.append(task)
            last = number == len(sources) - 1
            deadline = asyncio.get_running_loop().time() + (FETCH_S if last else HEDGE_S)
            while pending := [task for task in asked if not task.done()]:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for done in asked:
                    if done.done() and (answer := done.result()) is not None:
                        return answer
                if not last and all(task.done() for task in asked):
                    break  # the parent answered nothing valid: ask the next one now
        raise TimeoutError(f"no member served the group {group_id.hex()[:16]}")

    def _keep_start(self, group_id: bytes, peers: list[PeerID], gathered: Sequence[bytes]) -> None:
        """Hold the group ``group_id`` to serve to its members, and wake the calls waiting for it."""
        kept: dict[bytes, averaging_pb2.MessageFromLeader] = self.__dict__.setdefault("_starts", {})
        kept[group_id] = averaging_pb2.MessageFromLeader(
            code=averaging_pb2.BEGIN_ALLREDUCE,
            group_id=group_id,
            ordered_peer_ids=[peer.to_bytes() for peer in peers],
            gathered=list(gathered),
        )
        for old in list(kept)[:-STARTS_KEPT]:
            del kept[old]
        waiting: dict[bytes, asyncio.Future[None]] = self.__dict__.setdefault("_start_waits", {})
        woken = waiting.pop(group_id, None)
        if woken is not None and not woken.done():
            woken.set_result(None)

    def _count_start_sent(self, group_id: bytes, sent: int) -> None:
        counts: dict[bytes, int] = self.__dict__.setdefault("_start_sent", {})
        counts[group_id] = counts.get(group_id, 0) + sent
        for old in list(counts)[:-STARTS_KEPT]:
            del counts[old]

    def start_sent(self, group_id: bytes) -> int:
        """Bytes this member sent to start the group ``group_id``: a leader's start messages,
        and the group served to members that fetched it here."""
        return int(self.__dict__.get("_start_sent", {}).get(group_id, 0))

    async def serve_start(self, group_id: bytes, asker: PeerID) -> averaging_pb2.MessageFromLeader:
        """The whole group ``group_id`` for ``asker``, a member of it; a refusal
        (``NOT_LOOKING_FOR_GROUP``) where this member does not hold that group within
        ``FETCH_S`` or ``asker`` is not in it. A group not held yet is waited for only while
        this member looks for a group, by at most ``MAX_START_WAITERS`` calls at once and
        ``MAX_WAITS_PER_ASKER`` of one peer's."""
        kept: dict[bytes, averaging_pb2.MessageFromLeader] = self.__dict__.setdefault("_starts", {})
        found = kept.get(group_id)
        waiters: int = self.__dict__.get("_start_waiters", 0)
        by_asker: dict[bytes, int] = self.__dict__.setdefault("_start_waiters_by", {})
        key = asker.to_bytes()
        if (
            found is None
            and self.is_looking_for_group
            and waiters < MAX_START_WAITERS
            and by_asker.get(key, 0) < MAX_WAITS_PER_ASKER
        ):
            waiting: dict[bytes, asyncio.Future[None]] = self.__dict__.setdefault("_start_waits", {})
            woken = waiting.setdefault(group_id, asyncio.get_running_loop().create_future())
            self.__dict__["_start_waiters"] = waiters + 1
            by_asker[key] = by_asker.get(key, 0) + 1
            try:
                await asyncio.wait_for(asyncio.shield(woken), FETCH_S)
            except TimeoutError:
                pass
            finally:
                by_asker[key] -= 1
                if by_asker[key] == 0:
                    del by_asker[key]
                self.__dict__["_start_waiters"] -= 1
                if self.__dict__["_start_waiters"] == 0:
                    waiting.clear()  # groups that never came (one that came was taken out)
            found = kept.get(group_id)
        if found is None or asker.to_bytes() not in found.ordered_peer_ids:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        self._count_start_sent(group_id, found.ByteSize())
        return found
