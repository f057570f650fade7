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
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.mpfuture import MPFuture

from engine import pooled
from engine.allreduce import (
    PART_SIZE_BYTES,
    CodecCompression,
    ExactAllReduceRunner,
    RoundFailedError,
    group_round,
    part_size_bytes,
    stale_members,
)
from engine.auditing import AuditMixin, AuditOutcome
from engine.averager_gate import AdmissionGateMixin
from engine.bulk_channel import BulkChannelMixin
from engine.bulk_settings import BulkSettings
from engine.compression import Codec
from engine.fragments import fragment_bounds, fragment_group_id
from engine.link_timeouts import CAP as LINK_CAP
from engine.link_timeouts import RoundTimeouts, stretched
from engine.liveness import LivenessMixin
from engine.matchmaking import KeptRosters, equal_shares, gathered_metadata, round_group_bits
from engine.outcome import AllReduceStats, GroupOutcome
from engine.process_memory import release_free_memory
from engine.process_signals import OwnSignals
from engine.receipts import ReceiptSigner
from engine.robust import RobustRule
from engine.serving import SHUTDOWN_S, BackgroundServingMixin
from engine.start_tree import FANOUT
from engine.state_transfer import StateProvider, StateTransferMixin
from engine.update_store import PendingUpdate, UpdateStore
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
        self.fragments = fragment_bounds(numel, streams)
        """``[start, end)`` of each fragment averaged at once (one for ``streams`` = 1)."""
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
        self.vector = torch.zeros(numel, dtype=torch.float32)  # shared by hivemind; use under its lock
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
        started = time.monotonic()
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.pop("compression", None)
        kwargs.pop("part_size_bytes", None)
        stale = stale_members(group_info, self.serializer)
        round_ = group_round(group_info, self.serializer)
        codec = self.codec_compression.at_round(round_)
        if stale:
            logger.warning(
                "round with %s: they started from another state than the group; their parts count 0",
                sorted(map(str, stale)),
            )
        (vector,) = tensors
        flat = vector.view(-1)
        fragment_ids = [fragment_group_id(group_id, index) for index in range(len(self.fragments))]
        room = self._open_audit_room(group_id, fragment_ids, group_info.peer_ids, stale) if self.audit else None
        signer = self._receipt_signer(group_info, round_)
        await self.open_paths(group_info.peer_ids, kwargs.get("peer_fractions"))
        update = self._pending_update(round_)  # written as its parts arrive (None: keeps none)
        runners = [
            self._fragment_runner(flat[start:end], group_info, fragment_id, stale, codec, kwargs, signer, update, start)
            for fragment_id, (start, end) in zip(fragment_ids, self.fragments)
        ]
        if room is not None:
            room.runners.extend(runners)
        outcomes = await asyncio.gather(
            *(self._run_fragment(runner, group_info) for runner in runners), return_exceptions=True
        )
        offences = pooled.offences(runners, self.robust)
        for peer, reason in sorted(offences.items()):
            logger.warning("round's contribution from %s bounded by this reducer: %s", peer, reason)
        if errors := [outcome for outcome in outcomes if isinstance(outcome, BaseException)]:
            if room is not None:  # the others need not wait for this peer's verdict
                await self._tell_no_verdict(group_id, room)
            raise errors[0]
        missing = [
            (start + lo, start + hi)
            for runner, (start, _end) in zip(runners, self.fragments)
            for lo, hi in runner.missing_ranges()
        ]
        left_out = sum(hi - lo for lo, hi in missing)
        failed = pooled.failed_reducers(runners)
        if left_out >= self.numel:
            if room is not None:
                await self._tell_no_verdict(group_id, room)
            raise RoundFailedError(f"no averaged part arrived: {failed}")
        for peer, reason in failed.items():
            if peer != str(self.peer_id):
                offences.setdefault(peer, f"reducer failed: {reason}")
        if missing:
            logger.warning(
                "round completed without the ranges of reducers %s (%.1f%% of the vector left out of this round)",
                sorted(failed),
                100.0 * left_out / max(1, self.numel),
            )
        # kept with the ranges it left out, which the host states when the round lands
        self._spool_update(round_, update)
        audit = AuditOutcome()
        if room is not None and runners[0].modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            try:
                audit = await self._audit_round(group_id, room, [start for start, _ in self.fragments])
            except Exception:  # an audit that breaks here never fails the round
                logger.exception("audit of this round failed here; nobody is judged")
            for peer, reason in audit.caught.items():
                offences[peer] = f"audit: its average is wrong: {reason}"
        self._stats[group_id] = AllReduceStats(
            bytes_sent=sum(runner.bytes_sent for runner in runners),
            bytes_received=sum(runner.bytes_received for runner in runners),
            refused_senders={str(k): v for runner in runners for k, v in runner.refused_senders.items()},
            offences=offences,
            allreduce_s=time.monotonic() - started,
            peer_ids=[str(p) for p in group_info.peer_ids],
            streams=len(runners),
            missing=missing,
            left_out=sorted(audit.left_out),
            audit_s=audit.seconds,
            audit_bytes=audit.bytes_received,
            receipts=pooled.receipts(runners),
            over_bulk=sorted(str(peer) for peer in set.intersection(*(runner.over_bulk for runner in runners))),
        )
        del runners, outcomes  # the round's parts, frames and buffers are garbage now: their pages go back
        asyncio.get_running_loop().run_in_executor(None, release_free_memory)

    def _receipt_signer(self, group_info: GroupInfo, round_: int) -> ReceiptSigner | None:
        """Who signs this round's receipts: the node's identity, for the round the group lands
        (its agreed state's round + 1, the round its members report)."""
        if self._receipt_key is None:
            return None
        if self._receipt_identity is None:  # loaded in the averager's process, once
            self._receipt_identity = Identity.from_pem(self._receipt_key, source="the node's key")
        ids = {}
        for peer, raw in zip(group_info.peer_ids, group_info.gathered):
            data = gathered_metadata(raw)
            if data is not None and data.id:
                ids[str(peer)] = data.id
        return ReceiptSigner(self._receipt_identity, run=self.prefix, round_=round_ + 1, ids=ids)

    def _fragment_runner(
        self,
        fragment: torch.Tensor,
        group_info: GroupInfo,
        group_id: bytes,
        stale: frozenset[Any],
        codec: CodecCompression,
        kwargs: dict[str, Any],
        signer: ReceiptSigner | None = None,
        update: PendingUpdate | None = None,
        start: int = 0,
    ) -> ExactAllReduceRunner:
        runner = self.runner_class(
            codec=codec,
            receipts=signer,
            bulk=self.bulk_pool(),
            stale=stale,
            robust=self.robust,
            keep_sent=self.audit,
            spill=self.update_store.directory if self.update_store is not None else None,
            keep_averaged=update.at(start) if update is not None else None,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=[fragment],
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        future = self._running_groups.get(group_id)
        assert future is not None, "group must be registered before all-reduce"
        future.set_result(runner)
        return runner

    async def _run_fragment(self, runner: ExactAllReduceRunner, group_info: GroupInfo) -> None:
        """One fragment's all-reduce; its averaged parts land in the fragment (``InPlaceOutputs``)."""
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        async for _ in runner:
            pass
        await self._serve_in_background(runner)  # the senders' last parts: beside the next work
        if self.peer_id in runner.failed_reducers:
            # this peer's own parts failed here (a local fault): the others may hold its range
            raise RoundFailedError(f"this peer could not average its own parts: {runner.failed_reducers[self.peer_id]}")

    async def _step(self, *, step: Any, future_for_init: Any) -> None:
        """Look for the group under the key of the round this step averages (its gathered
        ``meet``, else ``round``): each round meets at its own DHT key, so a round's leftover declarations
        (a long window, ``engine.matchmaking``) never stand in the next round's way, and a
        peer a round behind meets nobody it would only average stale with."""
        metadata = gathered_metadata(step.data_for_gather)
        round_ = (metadata.meet if metadata.meet is not None else metadata.round) if metadata is not None else None
        if round_ is not None:
            self._matchmaking.group_key_manager.group_bits = round_group_bits(round_)
        await super()._step(step=step, future_for_init=future_for_init)

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
            deadline = None if math.isinf(timeouts.allreduce_s) else timeouts.allreduce_s
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
