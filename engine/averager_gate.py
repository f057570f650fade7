"""Authorized averaging inside the averager process: only peers the run's ``MemberGate``
admits (``protocol.membership``) may ask to join our groups, lead a group we join, be in a
group we average with, or download our state. Mixed into ``engine.averager.ExactAverager``
(before hivemind's ``DecentralizedAverager``, whose handlers it wraps)."""

from __future__ import annotations

import asyncio
import logging
import typing
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.matchmaking import round_matchmaking
from engine.start_tree import FANOUT
from engine.state_wanted import Wanted
from engine.stream_close import until_reader_closes
from protocol.membership import Lookup, MemberGate

logger = logging.getLogger(__name__)


class AdmissionGateMixin:
    """Refuses join requests, leaders and state downloads of peers the gate does not admit."""

    gate: MemberGate | None
    """When set, only the peers it admits may join our groups, lead them or download state."""
    dht: Any
    peer_id: PeerID
    serializer: Any

    if typing.TYPE_CHECKING:

        def _serve_state(self, wanted: Wanted | None = None) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
            """The state's stream (``engine.state_transfer.StateTransferMixin``)."""
            ...

    async def _admitted(self, peer: PeerID, *, stale_ok: bool = False) -> bool:
        """Whether the run's gate admits ``peer`` (``MemberGate.admitted``; ``stale_ok``: a
        member at the last lookup counts while a due lookup runs in the background)."""
        if self.gate is None or peer == self.peer_id:
            return True
        gate = self.gate

        async def fetch() -> Lookup:
            # both keys at once: one lookup's time, not two (a second on a home link)
            members, revocations = await asyncio.gather(
                self.dht.get(gate.key, latest=True, return_future=True),
                self.dht.get(gate.revocations_key, latest=True, return_future=True),
            )
            return Lookup.from_found(members, revocations)

        return await gate.admitted(str(peer), fetch, stale_ok=stale_ok)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads typing's hint
        """hivemind's, for admitted peers only; the stream ends once the requester has read the
        leader's last message (``engine.stream_close``: a lost ``BEGIN_ALLREDUCE`` leaves a member
        in the group that never takes part)."""
        async for message in until_reader_closes(self._join_group(request, context)):
            yield message

    async def _join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        self._matchmaking.note_arrival(context)  # before the lookup: its sender's clock runs
        try:
            if not await self._admitted(context.remote_id):
                logger.warning("refused a join request from %s: not admitted to this run", context.remote_id)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for response in super().rpc_join_group(request, context):  # type: ignore[misc]
                yield response
        finally:
            self._matchmaking.forget_arrival(context)

    async def rpc_group_start(
        self, request: averaging_pb2.MessageFromLeader, context: Any
    ) -> averaging_pb2.MessageFromLeader:
        """The whole group ``request.group_id`` for a member of it that its leader sent here for
        it (``engine.start_tree``); refused to peers the run does not admit, and to anyone not
        in the group."""
        if not await self._admitted(context.remote_id, stale_ok=True):
            logger.warning("refused a group's start to %s: not admitted to this run", context.remote_id)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        answer: averaging_pb2.MessageFromLeader = await self._matchmaking.serve_start(
            bytes(request.group_id), context.remote_id
        )
        return answer

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, for admitted peers only; the stream ends once the downloader, which
        closes it as soon as it holds both vectors, has read the last chunk
        (``engine.stream_close``). Served for downloaders that do not say what they want (ours
        use ``rpc_download_wanted_state``)."""
        async for message in until_reader_closes(self._download_state(context, None)):
            yield message

    async def rpc_download_wanted_state(
        self, request: averaging_pb2.AveragingData, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """The state download whose request names the states it takes (``engine.state_wanted``,
        in hivemind's spare ``AveragingData.peer_id``): any other state is answered with its
        metadata alone. Admitted peers only; a malformed request gets an error and nothing else."""
        wanted = Wanted.parse(self.serializer, bytes(request.peer_id))
        if wanted is None:
            logger.warning("refused a state download by %s: a malformed request", context.remote_id)
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": "malformed request"}))
            return
        async for message in until_reader_closes(self._download_state(context, wanted)):
            yield message

    async def _download_state(
        self, context: Any, wanted: Wanted | None
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admitted(context.remote_id):
            logger.warning("refused a state download by %s: not admitted to this run", context.remote_id)
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": "not admitted to this run"}))
            return
        # the metadata on its own first, so that a downloader that would refuse this state
        # (another digest than it asks for) does so before any tensor bytes cross its link
        async for message in self._serve_state(wanted):
            yield message

    @property
    def _matchmaking(self) -> Any:
        try:
            return self.__dict__["_gated_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Any) -> None:
        """hivemind creates its Matchmaking inside the averager process: make it the run's
        one-group matchmaking (``engine.matchmaking``), and wrap its requests to leaders so
        this peer never asks a leader that is not admitted or that it distrusts (it would fail
        the round)."""
        matchmaking = round_matchmaking(matchmaking)
        matchmaking.start_fanout = getattr(self, "start_fanout", FANOUT)
        request_join = matchmaking._request_join_group

        async def request_admitted_leader(leader: PeerID) -> Any:
            if not await self._admitted(leader):
                logger.info("not joining %s's group: it is not admitted to this run, or caught lying", leader)
                return None
            return await request_join(leader)

        matchmaking._request_join_group = request_admitted_leader
        self.__dict__["_gated_matchmaking"] = matchmaking
