"""One group per round: hivemind's matchmaking with no size bound and a leader that starts the
all-reduce as soon as the whole roster is in (``protocol.roster.leader_may_close``).

hivemind's leader (the looking peer with the earliest declared expiration) closes its group
when ``target_group_size`` peers joined or when its expiration comes. A bound on the size
splits a swarm larger than it into several groups, each landing another state; so the run's
group has no bound, and every peer declares an expiration near its deadline
(``Swarm.start_round``: a long window), so peers that launch a phase apart still find the
same leader. A long window would make every round wait for it; instead the leader closes as
soon as every member of the roster of the group's state has joined (torchft's "fast
quorum": the previous round's members are all back). Only a round whose roster lost a member
(it left, died, or runs late) waits out the window. Safety does not rest on this: the roster
rule (``protocol.roster.verdict``) decides which group's state lands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from protocol.roster import leader_may_close, verdict

__all__ = ["RoundMatchmaking", "gathered_metadata", "round_group_bits", "round_matchmaking"]

logger = logging.getLogger(__name__)

STALE_REQUEST_FRACTION = 0.5
"""A join request that waited longer than this fraction of ``request_timeout`` before the
leader could answer it is turned away (``RoundMatchmaking._check_reasons_to_reject``)."""


def gathered_metadata(gather: bytes) -> object:
    """The swarmtrain metadata inside hivemind's gathered bytes ``[bandwidth, mode, user bytes]``
    (None if malformed: a follower's bytes are untrusted input)."""
    try:
        _bandwidth, _mode, user = MSGPackSerializer.loads(gather)
        return MSGPackSerializer.loads(user)
    except Exception:  # noqa: BLE001 - any malformed payload is just "no metadata"
        return None


def round_group_bits(round_: int) -> str:
    """hivemind's group bits (its DHT key is ``PREFIX.0b<bits>``) of the round ``round_``: each
    round's peers meet under a key of their own."""
    return format(round_, "b")


class RoundMatchmaking(Matchmaking):
    """hivemind's ``Matchmaking`` whose size bound is read at each join: the group's current
    size once the roster is complete (hivemind then assembles the group at once), else the
    bound it was built with (a run's peers: none; a bare averager of a test or benchmark may
    set one, as in hivemind)."""

    @property
    def target_group_size(self) -> int | None:
        bound: int | None = self.__dict__.get("_bound")
        followers = getattr(self, "current_followers", {})
        if not followers or getattr(self, "step_control", None) is None:
            return bound
        metadata = self._metadata()  # parsed once per round (the bound is read at every join)
        if leader_may_close(metadata) and self._first_in_line():
            if self.__dict__.get("_closed_step") is not self.step_control:  # hivemind reads the bound twice
                self.__dict__["_closed_step"] = self.step_control
                logger.info("the roster is complete (%d members): starting the round's all-reduce", len(metadata))
            return len(metadata)
        return bound

    @target_group_size.setter
    def target_group_size(self, value: int | None) -> None:
        self.__dict__["_bound"] = value

    def _first_in_line(self) -> bool:
        """Whether this peer leads: it has read the round's declarations at least once since it
        declared, and none of them would lead before it (hivemind's order: earliest declared
        expiration, then peer id). A peer that is itself to follow an earlier leader (a
        newcomer that launched first, say) must not close its own group: that would split the
        round, the earlier leader's group and its own."""
        search = self.potential_leaders
        if search.max_assured_time == float("-inf"):
            return False
        mine = (search.declared_expiration_time, self.peer_id.to_bytes())
        return all((entry.expiration_time, peer.to_bytes()) > mine for peer, entry in search.leader_queue.items())

    def _metadata(self) -> list[object]:
        """Every current member's gathered metadata (this peer's first), each parsed once per round."""
        followers = getattr(self, "current_followers", {})
        gathers = [self.step_control.data_for_gather] + [request.gather for request in followers.values()]
        cache: dict[bytes, object] = self.__dict__.get("_parsed_gathers", {})
        cache = {data: cache[data] if data in cache else gathered_metadata(data) for data in gathers}
        self.__dict__["_parsed_gathers"] = cache
        return [cache[data] for data in gathers]

    def note_arrival(self, context: object) -> None:
        """The join request of the call ``context`` has just arrived
        (``AdmissionGateMixin.rpc_join_group`` calls this before anything that may wait, such
        as its admission lookup; the first note counts)."""
        self.__dict__.setdefault("_arrivals", {}).setdefault(id(context), time.monotonic())

    def forget_arrival(self, context: object) -> None:
        """The call ``context`` has ended."""
        self.__dict__.get("_arrivals", {}).pop(id(context), None)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        self.note_arrival(context)
        try:
            async for message in super().rpc_join_group(request, context):
                yield message
        finally:
            self.forget_arrival(context)

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> averaging_pb2.MessageFromLeader | None:
        """hivemind's reasons, and one more: the request waited here (for the admission lookup,
        or for this peer's own request to a leader to end: hivemind holds one lock for both)
        more than half of the time its sender waits for an answer (``request_timeout``). Its
        sender has given up on it or is about to, and hivemind would still count it in the
        group: a member that never takes part, whose range of the vector fails the round for
        every other member. Turned away, it asks another leader (or this one again)."""
        reason = super()._check_reasons_to_reject(request, context)
        if reason is not None:
            return reason
        arrived = self.__dict__.get("_arrivals", {}).get(id(context))
        waited = time.monotonic() - arrived if arrived is not None else 0.0
        if waited > STALE_REQUEST_FRACTION * self.request_timeout:
            logger.info(
                "turned away %s's join request: it waited %.2f s here, its sender gives up after %.2f s",
                context.remote_id,
                waited,
                self.request_timeout,
            )
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return None

    @property
    def min_group_size(self) -> int:
        """hivemind assembles a group whose window ended when it holds this many members: the
        run's ``min_group_size``, unless the group as it stands would fail the roster rule
        (``protocol.roster.verdict``): then one more than it holds, so the leader disbands it and
        keeps looking (its followers with it) until its deadline, rather than start a round
        that cannot land."""
        base: int = self.__dict__.get("_min_group_size", 1)
        if getattr(self, "step_control", None) is None:
            return base
        members = self._metadata()
        if verdict(members, min_group_size=base).lands:
            return base
        return len(members) + 1

    @min_group_size.setter
    def min_group_size(self, value: int) -> None:
        self.__dict__["_min_group_size"] = value


def round_matchmaking(matchmaking: Matchmaking) -> RoundMatchmaking:
    """Turn the ``Matchmaking`` hivemind built inside the averager process into a
    ``RoundMatchmaking`` (same state; hivemind constructs it itself, so it is re-classed)."""
    if not isinstance(matchmaking, RoundMatchmaking):
        bound = matchmaking.__dict__.pop("target_group_size", None)
        smallest = matchmaking.__dict__.pop("min_group_size", 1)
        matchmaking.__class__ = RoundMatchmaking
        matchmaking.__dict__["_bound"] = bound
        matchmaking.__dict__["_min_group_size"] = smallest
    return matchmaking
