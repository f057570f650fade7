"""``ExactAverager``: the run's hivemind averager (DHT matchmaking, libp2p transport) over one
flat float32 vector, with bit-identical results (``engine.allreduce``), authorized
membership (``engine.averager_gate``) and verified state transfer
(``engine.state_transfer``). The vector averaged is whatever the caller puts in it (a
pseudo-gradient). After a round it holds the average except in the ranges of reducers that
failed (``AllReduceStats.missing``: ``[start, end)`` pairs), which the caller leaves out of the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.mpfuture import MPFuture

from engine.allreduce import (
    PART_SIZE_BYTES,
    CodecCompression,
    ExactAllReduceRunner,
    RoundFailedError,
    part_size_bytes,
)
from engine.auditing import AuditMixin
from engine.averager_gate import AdmissionGateMixin
from engine.bulk_channel import BulkChannelMixin
from engine.bulk_settings import BulkSettings
from engine.compression import Codec
from engine.fragment_rounds import FragmentRoundsMixin, sync_layout
from engine.fragments import fragment_group_id
from engine.link_timeouts import CAP as LINK_CAP
from engine.link_timeouts import RoundTimeouts, stretched
from engine.liveness import LivenessMixin
from engine.matchmaking import KeptRosters, equal_shares, gathered_metadata, round_group_bits
from engine.outcome import AllReduceStats, GroupOutcome
from engine.process_signals import OwnSignals
from engine.robust import RobustRule
from engine.serving import SHUTDOWN_S, BackgroundServingMixin
from engine.start_tree import FANOUT
from engine.state_transfer import StateProvider, StateTransferMixin
from engine.update_store import UpdateStore
from engine.update_transfer import UpdateTransferMixin
from protocol.gathered import Gathered
from protocol.identity import Identity
from protocol.membership import MemberGate

__all__ = ["AllReduceStats", "ExactAverager", "GroupOutcome", "RoundFailedError", "StateProvider"]

logger = logging.getLogger(__name__)

ABANDON_ANSWER_S = 5.0
"""How long ``ExactAverager.abandon_search`` waits for the averager process to end the search."""

if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
    # hivemind switches torch to the "file_system" strategy on import: the averager's shared
    # vector (and every tensor its processes pass) is then a named file in /dev/shm that only
    # torch_shm_manager unlinks, once the last process using it is gone. A peer killed with its
    # process group (a container or systemd stop, the OOM killer's group kill) takes the manager
    # along and leaves the whole vector behind, in RAM, every time. With "file_descriptor" the
    # memory has no name (unlinked at creation) and the kernel frees it with the last process.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")


class ExactAverager(
    OwnSignals,
    AuditMixin,
    AdmissionGateMixin,
    BulkChannelMixin,
    StateTransferMixin,
    UpdateTransferMixin,
    LivenessMixin,
    BackgroundServingMixin,
    FragmentRoundsMixin,
    DecentralizedAverager,
):
    """A DecentralizedAverager over one flat float32 vector with bit-identical results.

    After a successful ``step`` the vector (``get_tensors()[0]``) holds the weighted
    average of the group's decoded contributions, identical in every member.

    With ``streams`` > 1 the vector is cut into fragments (``engine.fragments``; every member
    must be given the same ``streams``: it is the spec's ``averaging.streams``), each averaged
    by its own ``ExactAllReduceRunner``, all at once, with the same group, over their own
    libp2p streams: one stream per sender-reducer pair caps at what one stream's flow-control
    window carries (``benchmarks/wan_averaging.py``, docs/design/round.md step 7, "Parallel streams").

    With ``audit`` every member audits one reducer per round and leaves one caught lying out
    (``engine.audit``, ``engine.auditing``).

    With ``updates`` (a store; not in client mode, where nobody could fetch from it) it keeps
    the averaged update of each round that landed here and serves it to newcomers
    (``engine.update_store``, ``engine.update_transfer``).

    With ``receipt_key`` (the node's identity, PEM) its reducer signs a receipt for each sender
    it served (``protocol.receipts``), and it keeps the receipts its reducers sent it
    (``AllReduceStats.receipts``).
    """

    runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner

    def __init__(
        self,
        numel: int,
        dht: Any,
        *,
        codec: Codec,
        prefix: str,
        gate: MemberGate | None = None,
        streams: int = 1,
        sync_fragments: int = 1,
        robust: RobustRule | None = None,
        audit: bool = False,
        updates: UpdateStore | None = None,
        receipt_key: bytes | None = None,
        bulk: BulkSettings | None = None,
        start_fanout: int = FANOUT,
        **kwargs: Any,
    ) -> None:
        self.audit = audit
        self.start_fanout = start_fanout
        """Followers a leader of this peer's sends the whole group to (``engine.start_tree``)."""
        self.bulk = bulk if bulk is not None else BulkSettings(enabled=False)
        self._receipt_key = receipt_key
        self._receipt_identity: Identity | None = None
        self.update_store = None if kwargs.get("client_mode") else updates
        self.codec_compression = CodecCompression(codec)
        self.numel = numel
        self.syncs, self.sync_parts = sync_layout(numel, sync_fragments, streams)
        """``[start, end)`` of each fragment averaged in turn (one for ``sync_fragments`` = 1), and
        of each one's fragments averaged at once (``engine.fragment_rounds``)."""
        self.fragments = [bounds for parts in self.sync_parts for bounds in parts]
        """Every fragment averaged at once, in order, in the whole vector's coordinates."""
        self.robust = robust if robust is not None else RobustRule.off()
        """How this peer's reducer bounds each member's contribution (``engine.robust``; the
        run's spec gives the rule, a bare averager takes the plain weighted mean)."""
        self.gate = gate
        """When set, only the peers it admits may join our groups, lead them or download state."""
        self._stats: dict[bytes, AllReduceStats] = {}
        self.state_provider: StateProvider | None = None
        """Set in the host process: returns the (round, params, momentum, digest) to serve."""
        own = kwargs.get("allreduce_timeout")
        self._own_allreduce_s: float | None = None if own is None else float(own)
        """This peer's all-reduce deadline; hivemind's (``_allreduce_timeout``) is ``LINK_CAP``
        times it: the longest a round stretched to a slow member's link may take."""
        if own is not None:
            kwargs["allreduce_timeout"] = LINK_CAP * float(own)
        kwargs.setdefault("shutdown_timeout", SHUTDOWN_S)  # room for the senders' last parts
        buffer = max(end - start for start, end in self.syncs)
        # shared by hivemind; use under its lock, or (fragments in turn) between a gate's answer and its next open
        self.vector = torch.zeros(buffer, dtype=torch.float32)
        kwargs.update(prefix=prefix, compression=self.codec_compression, part_size_bytes=PART_SIZE_BYTES)
        super().__init__([self.vector], dht, **kwargs)

    async def _shutdown(self, timeout: float | None) -> None:
        await self._drain_serving()  # a leaving reducer's senders get their last parts first
        await super()._shutdown(timeout)

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        # register every fragment's group id before hivemind's own registration wakes the
        # handlers of parts that arrived early (``rpc_aggregate_part``)
        extra = [fragment_group_id(group_info.group_id, index) for index in range(1, len(self.fragments))]
        for group_id in extra:
            self._running_groups[group_id] = asyncio.Future()
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            for group_id in extra:
                future = self._running_groups.pop(group_id, None)
                if future is not None and not future.done():
                    future.cancel()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        await self._average_in_fragments(tensors, group_info, group_id, **kwargs)

    async def _step(self, *, step: Any, future_for_init: Any) -> None:
        """Look for the group under the key of the round this step averages (its gathered
        ``meet``, else ``round``): each round meets at its own DHT key, so a round's leftover declarations
        (a long window, ``engine.matchmaking``) never stand in the next round's way, and a
        peer a round behind meets nobody it would only average stale with."""
        metadata = gathered_metadata(step.data_for_gather)
        round_ = (metadata.meet if metadata.meet is not None else metadata.round) if metadata is not None else None
        if round_ is not None:
            self._matchmaking.group_key_manager.group_bits = round_group_bits(round_)
        if metadata is not None and metadata.round is not None and self.in_turn:
            self._sync_gates().begin(metadata.round)
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        finally:  # a round that found no group, or whose all-reduce is over: its gates are answered
            if metadata is not None and metadata.round is not None:
                self._close_gates(metadata.round, "the round found no group here")

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> GroupOutcome:
        """Returns the group's ``GroupOutcome`` to ``step()``'s caller.

        A group with a member the run did not admit is refused before anything is sent (an
        exception: hivemind looks for another group until the step's deadline). Once the
        all-reduce has begun, its failure here is the round's outcome for this peer
        (``GroupOutcome.failed``, the whole vector ``missing``), not an exception: hivemind
        would retry the step, looking for a group at a round key its group has left (the
        others land without this peer and move on), for up to the whole matchmaking timeout,
        and with a vector the failed exchange may have partly overwritten."""
        outsiders = [peer for peer in group_info.peer_ids if not await self._admitted(peer)]
        if outsiders:
            raise RoundFailedError(f"group includes peers not admitted to this run: {sorted(map(str, outsiders))}")
        # each member's share of the vector is equal, not what it says its bandwidth is
        group_info = dataclasses.replace(group_info, gathered=equal_shares(group_info.gathered))
        led = self._matchmaking.led()  # a RoundMatchmaking (AdmissionGateMixin._matchmaking)
        timeouts = self._round_timeouts(group_info)
        kwargs.update(sender_timeout=timeouts.sender_s, reducer_timeout=timeouts.reducer_s)
        try:
            deadline = None if math.isinf(timeouts.allreduce_s) else timeouts.allreduce_s + self.sync_span_s
            gathered = await asyncio.wait_for(
                super()._aggregate_with_group(group_info, min_vector_size, **kwargs), deadline
            )
        except (TimeoutError, MatchmakingException) as exc:  # hivemind wraps the all-reduce's failures
            self._stats.pop(group_info.group_id, None)
            statements = {
                str(peer): gathered_metadata(raw) for peer, raw in zip(group_info.peer_ids, group_info.gathered)
            }
            stats = AllReduceStats(peer_ids=list(statements), missing=[(0, self.numel)])
            why = str(exc) or f"the all-reduce outlasted its {timeouts.allreduce_s:.1f} s"
            return GroupOutcome(statements, stats, led, failed=why)
        stats = self._stats.pop(group_info.group_id, AllReduceStats())
        stats.start_bytes = self._matchmaking.start_sent(group_info.group_id)
        parsed = {peer: Gathered.parse(raw) for peer, raw in gathered.items()}
        members = {str(peer): data for peer, data in parsed.items()}
        if not stats.missing:  # the state this group makes: its roster, for the next round's leader
            self._matchmaking.note_group(
                [data for data in members.values() if data is not None],
                peers={data.id: peer for peer, data in parsed.items() if data is not None and data.id},
            )
        return GroupOutcome(members, stats, led)

    def _round_timeouts(self, group_info: GroupInfo) -> RoundTimeouts:
        """This round's deadlines: this peer's own (``set_allreduce_timeout``), stretched to the
        slowest link the group's members stated (``engine.link_timeouts``): every member computes
        the same from the same statements."""
        own = self._own_allreduce_s
        base = RoundTimeouts(
            sender_s=float(self.allreduce_kwargs.get("sender_timeout") or (own or 180.0) / 3),
            reducer_s=float(self.allreduce_kwargs.get("reducer_timeout") or 2 * (own or 180.0) / 3),
            allreduce_s=math.inf if own is None else own,
        )
        if own is None:  # no deadline: nothing to stretch
            return base
        links = [data.link if data is not None else None for data in map(gathered_metadata, group_info.gathered)]
        codec = self.codec_compression.codec
        size = len(group_info.peer_ids)
        largest = max(end - start for start, end in self.fragments)
        return stretched(
            links,
            part_bytes=part_size_bytes(largest, codec, size),
            vector_bytes=int(self.numel * codec.bytes_per_value()),
            group_size=size,
            streams=len(self.fragments),
            base=base,
        )

    async def remove_p2p_handlers(self, p2p: Any, *, namespace: str | None = None) -> None:
        """hivemind's, at shutdown, but quiet when the p2p daemon is already gone: a Ctrl-C at a
        terminal reaches the daemon too (it shares the process group), and the removal then
        failed on its closed socket with a 30-line traceback from the averager's thread."""
        try:
            await super().remove_p2p_handlers(p2p, namespace=namespace)
        except (OSError, P2PDaemonError) as exc:
            logger.debug("averager handlers not removed: the p2p daemon is gone (%s)", exc)

    def abandon_search(self, timeout_s: float = ABANDON_ANSWER_S) -> bool:
        """End this peer's search for a group now, if its step is still matchmaking (a leader
        disbands its followers, who look on; a follower leaves its leader): the step then fails
        as "could not find a group", without retrying. True if the search was ended.

        hivemind's own way, ``StepControl.cancel``, cancels the step's matchmaking task without
        awaiting it; when the task was waiting on a join request, asyncio could collect it half
        cancelled ("Task was destroyed but it is pending"), and the search's cleanup never ran:
        every later search of that averager found no group (a home peer of the churn lab chased
        the swarm for 29 rounds after its first given-up search). This ends the search from
        inside, so that hivemind's ``look_for_group`` returns and cleans up as after a timeout."""
        future: MPFuture[bool] = MPFuture()
        self._outer_pipe.send(("_abandon_search", [], dict(future=future)))
        try:
            return bool(future.result(timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - the averager process is busy or gone: the search runs out
            logger.debug("could not end the search: %s", exc)
            return False

    async def _abandon_search(self, future: MPFuture[bool]) -> None:
        future.set_result(await self._matchmaking.give_up_search())

    def kept_rosters(self, timeout_s: float = ABANDON_ANSWER_S) -> KeptRosters:
        """The rosters this averager's matchmaking remembers (``RoundMatchmaking.kept_rosters``;
        none if its process does not answer within ``timeout_s``)."""
        future: MPFuture[KeptRosters] = MPFuture()
        self._outer_pipe.send(("_kept_rosters", [], dict(future=future)))
        try:
            return future.result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the averager process is busy or gone: nothing to keep
            logger.debug("could not read the kept rosters: %s", exc)
            return {}

    async def _kept_rosters(self, future: MPFuture[KeptRosters]) -> None:
        future.set_result(self._matchmaking.kept_rosters())

    def keep_rosters(self, kept: KeptRosters) -> None:
        """Hand ``kept`` (a former averager's ``kept_rosters`` of this peer) to this one's
        matchmaking, before the next step (the pipe keeps the order)."""
        self._outer_pipe.send(("_keep_rosters", [], dict(kept=kept)))

    async def _keep_rosters(self, kept: KeptRosters) -> None:
        self._matchmaking.keep_rosters(kept)

    def set_request_timeout(self, timeout_s: float) -> None:
        """How long this peer's join requests wait for a leader's answer from now on (hivemind's
        ``request_timeout``), before the next step (the pipe keeps the order)."""
        self._outer_pipe.send(("_set_request_timeout", [], dict(timeout_s=float(timeout_s))))

    async def _set_request_timeout(self, timeout_s: float) -> None:
        self._matchmaking.request_timeout = timeout_s

    def set_allreduce_timeout(self, timeout_s: float) -> None:
        """Change the all-reduce deadline (and per-chunk sender/reducer timeouts) from now on."""
        self._outer_pipe.send(("_set_allreduce_timeout", [], dict(timeout_s=float(timeout_s))))

    async def _set_allreduce_timeout(self, timeout_s: float) -> None:
        self._own_allreduce_s = timeout_s
        # hivemind's own deadline only bounds the longest a round may be stretched to
        # (``_round_timeouts``), which ``_aggregate_with_group`` enforces itself
        self._allreduce_timeout = LINK_CAP * timeout_s
        self.allreduce_kwargs["sender_timeout"] = timeout_s / 3
        self.allreduce_kwargs["reducer_timeout"] = 2 * timeout_s / 3
