"""A group's all-reduce, fragment by fragment (``ExactAverager._run_allreduce_inplace_`` runs it).

The vector is cut twice (``engine.fragments``): into ``sync_fragments`` fragments averaged one
after another (the spec's ``averaging.sync_fragments``; one: the whole vector at once, as
without it), and each of those into ``streams`` fragments averaged at once over their own
streams. With more than one fragment in turn the averager's buffer holds one of them: each waits
for the host to write it and open its gate (``engine.sync_gates``), is averaged by the group
that formed for the round, and is answered to the host, which lands it and writes the next. The
group, its deadlines, receipts and audits are the round's: one group per round, one matchmaking,
one audit (of the last fragment, whose answer waits for it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.mpfuture import MPFuture

from engine import pooled
from engine.allreduce import CodecCompression, ExactAllReduceRunner, RoundFailedError, group_round, stale_members
from engine.auditing import AuditOutcome
from engine.fragments import fragment_bounds, fragment_group_id
from engine.matchmaking import gathered_metadata
from engine.outcome import AllReduceStats, FragmentDone
from engine.process_memory import release_free_memory
from engine.receipts import ReceiptSigner
from engine.sync_gates import SyncGates
from engine.update_store import PendingUpdate
from protocol.identity import Identity

__all__ = ["FragmentDone", "FragmentRoundsMixin", "sync_layout"]

logger = logging.getLogger(__name__)


def sync_layout(
    numel: int, sync_fragments: int, streams: int
) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """``[start, end)`` of each fragment averaged in turn, and of each one's stream fragments
    (averaged at once), all in the whole vector's coordinates. One fragment in turn: the
    stream fragments are ``fragment_bounds(numel, streams)`` exactly."""
    syncs = fragment_bounds(numel, sync_fragments)
    parts = [[(start + lo, start + hi) for lo, hi in fragment_bounds(end - start, streams)] for start, end in syncs]
    return syncs, parts


class _Totals:
    """What a round's fragments found here, summed as each one ends (its runners then go)."""

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.refused: dict[str, str] = {}
        self.offences: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.receipts: dict[str, bytes] = {}
        self.over_bulk: set[str] | None = None
        self.missing: list[tuple[int, int]] = []
        self.streams = 0

    def add(self, runners: Sequence[ExactAllReduceRunner], offences: dict[str, str]) -> None:
        self.bytes_sent += sum(runner.bytes_sent for runner in runners)
        self.bytes_received += sum(runner.bytes_received for runner in runners)
        self.refused.update({str(k): v for runner in runners for k, v in runner.refused_senders.items()})
        for peer, reason in offences.items():
            self.offences.setdefault(peer, reason)
        for peer, reason in pooled.failed_reducers(runners).items():
            self.failed.setdefault(peer, reason)
        for peer, receipt in pooled.receipts(runners).items():
            self.receipts.setdefault(peer, receipt)
        bulk = set.intersection(*({str(peer) for peer in runner.over_bulk} for runner in runners))
        self.over_bulk = bulk if self.over_bulk is None else self.over_bulk & bulk
        self.streams += len(runners)


class FragmentRoundsMixin:
    """The all-reduce of a group, fragment by fragment, and the host's gates to it. The averager
    sets ``numel``, ``syncs``, ``sync_parts`` and ``fragments`` (``sync_layout``), ``vector``
    (the buffer: the longest fragment in turn), ``codec_compression``, ``robust``, ``audit``,
    ``update_store``, ``bulk`` and ``_receipt_key``."""

    numel: int
    syncs: list[tuple[int, int]]
    sync_parts: list[list[tuple[int, int]]]
    fragments: list[tuple[int, int]]
    vector: torch.Tensor
    codec_compression: CodecCompression
    audit: bool
    _receipt_key: bytes | None
    _receipt_identity: Identity | None
    _stats: dict[bytes, AllReduceStats]

    @property
    def in_turn(self) -> bool:
        """Whether fragments are averaged one after another, each when the host opens its gate."""
        return len(self.syncs) > 1

    def _sync_gates(self) -> SyncGates:
        gates = self.__dict__.get("_gates_in_process")
        if gates is None:  # made in the averager's process, on its loop
            gates = self.__dict__["_gates_in_process"] = SyncGates()
        return gates

    # --- the host's side (any process): through the averager's pipe, in order with its steps

    def open_fragment(self, round_: int, index: int) -> MPFuture[FragmentDone]:
        """Fragment ``index`` of round ``round_`` is written into the buffer (its first values):
        the averager may average it now. The future answers once it did, or could not."""
        future: MPFuture[FragmentDone] = MPFuture()
        self._outer_pipe.send(("_open_fragment", [int(round_), int(index)], dict(future=future)))  # type: ignore[attr-defined]
        return future

    async def _open_fragment(self, round_: int, index: int, future: MPFuture[FragmentDone]) -> None:
        start, end = self.syncs[index] if 0 <= index < len(self.syncs) else (0, 0)
        if not 0 <= index < len(self.syncs):
            future.set_result(FragmentDone(index, 0, 0, failed=f"no fragment {index} of {len(self.syncs)}"))
            return
        self._sync_gates().open(round_, index, future, start, end)

    def set_sync_span(self, span_s: float) -> None:
        """How far apart the group's members may open a fragment's gate (about an inner phase):
        each fragment's deadlines, and the round's, allow for it."""
        self._outer_pipe.send(("_set_sync_span", [], dict(span_s=max(0.0, float(span_s)))))  # type: ignore[attr-defined]

    async def _set_sync_span(self, span_s: float) -> None:
        self.__dict__["_sync_span_s"] = span_s

    @property
    def sync_span_s(self) -> float:
        """The span the host last set (0: fragments in turn are not used, or not yet timed)."""
        return float(self.__dict__.get("_sync_span_s", 0.0)) if self.in_turn else 0.0

    def _close_gates(self, round_: int, why: str) -> None:
        if self.in_turn:
            self._sync_gates().close(round_, why, self.syncs)

    # --- the averager's process

    async def _average_in_fragments(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        """``ExactAverager._run_allreduce_inplace_``: the group's all-reduce, fragment by fragment."""
        started = time.monotonic()
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.pop("compression", None)
        kwargs.pop("part_size_bytes", None)
        stale = stale_members(group_info, self.serializer)  # type: ignore[attr-defined]
        round_ = group_round(group_info, self.serializer)  # type: ignore[attr-defined]
        mine = gathered_metadata(group_info.gathered[group_info.peer_ids.index(self.peer_id)])  # type: ignore[attr-defined]
        gates = mine.round if mine is not None and mine.round is not None else round_
        """The gates are this peer's host's: keyed by the round it stated (a stale member's too,
        which still reduces its share for the others)."""
        codec = self.codec_compression.at_round(round_)
        if stale:
            logger.warning(
                "round with %s: they started from another state than the group; their parts count 0",
                sorted(map(str, stale)),
            )
        (vector,) = tensors
        flat = vector.view(-1)
        ids = [fragment_group_id(group_id, index) for index in range(len(self.fragments))]
        last = len(self.syncs) - 1
        first_audited = sum(len(parts) for parts in self.sync_parts[:last])
        audited_ids = ids[first_audited:]
        room = self._open_audit_room(group_id, audited_ids, group_info.peer_ids, stale) if self.audit else None  # type: ignore[attr-defined]
        signer = self._receipt_signer(group_info, round_)
        await self.open_paths(group_info.peer_ids, kwargs.get("peer_fractions"))  # type: ignore[attr-defined]
        update = self._pending_update(round_)  # type: ignore[attr-defined]  # written as its parts arrive (None: keeps none)
        totals = _Totals()
        statements = {str(peer): gathered_metadata(raw) for peer, raw in zip(group_info.peer_ids, group_info.gathered)}
        audit = AuditOutcome()
        span = self.sync_span_s
        deadline = (
            started + span + float(kwargs.get("sender_timeout") or 60.0) + float(kwargs.get("reducer_timeout") or 60.0)
        )
        if span:  # a member may open a fragment's gate up to a span after this one
            kwargs = dict(kwargs)
            for key in ("sender_timeout", "reducer_timeout"):
                if kwargs.get(key) is not None:
                    kwargs[key] = float(kwargs[key]) + span
        index = 0
        try:
            for sync, ((sync_start, sync_end), parts) in enumerate(zip(self.syncs, self.sync_parts)):
                opened = time.monotonic()
                if self.in_turn and not await self._sync_gates().wait(gates, sync, deadline - opened):
                    raise RoundFailedError(f"fragment {sync} of round {gates} was never written here")
                runners = [
                    self._fragment_runner(
                        flat[start - sync_start : end - sync_start],
                        group_info,
                        ids[index + k],
                        stale,
                        codec,
                        kwargs,
                        signer,
                        update,
                        start,
                        keep_sent=self.audit and sync == last,
                    )  # fmt: skip
                    for k, (start, end) in enumerate(parts)
                ]
                index += len(parts)
                if room is not None and sync == last:
                    room.runners.extend(runners)
                outcomes = await asyncio.gather(
                    *(self._run_fragment(runner, group_info) for runner in runners), return_exceptions=True
                )
                if errors := [outcome for outcome in outcomes if isinstance(outcome, BaseException)]:
                    raise errors[0]
                offences = pooled.offences(runners, self.robust)  # type: ignore[attr-defined]
                for peer, reason in sorted(offences.items()):
                    logger.warning("round's contribution from %s bounded by this reducer: %s", peer, reason)
                totals.add(runners, offences)
                missing = [
                    (start + lo, start + hi)
                    for runner, (start, _end) in zip(runners, parts)
                    for lo, hi in runner.missing_ranges()
                ]
                if sync == last and room is not None and self._audits_here(runners, group_info):
                    if sum(hi - lo for lo, hi in totals.missing + missing) >= self.numel:
                        await self._tell_no_verdict(group_id, room)  # type: ignore[attr-defined]  # nothing to audit
                    else:
                        audit = await self._audit_of(group_id, room, [start for start, _ in parts], totals)
                totals.missing.extend(missing)
                if self.in_turn:
                    self._sync_gates().answer(
                        gates,
                        FragmentDone(
                            sync, sync_start, sync_end, sorted(missing + audit.left_out),
                            bytes_sent=sum(r.bytes_sent for r in runners),
                            bytes_received=sum(r.bytes_received for r in runners),
                            allreduce_s=time.monotonic() - opened,
                            members=statements if sync == 0 else None,
                        ),
                    )  # fmt: skip
                del runners, outcomes  # a fragment's parts and buffers go before the next one's
        except Exception as exc:
            if room is not None:  # the others need not wait for this peer's verdict
                await self._tell_no_verdict(group_id, room)  # type: ignore[attr-defined]
            self._close_gates(gates, f"this peer's all-reduce failed: {type(exc).__name__}: {exc}")
            raise
        except BaseException:  # cancelled (the round's deadline): its gates are answered, nothing awaited
            self._close_gates(gates, "this peer's all-reduce was cancelled")
            raise
        self._close_gates(gates, "the round's all-reduce is over")
        self._finish_round(group_id, group_info, started, round_, update, totals, audit)

    def _audits_here(self, runners: Sequence[ExactAllReduceRunner], group_info: GroupInfo) -> bool:
        return runners[0].modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX  # type: ignore[attr-defined]

    async def _audit_of(self, group_id: bytes, room: Any, starts: list[int], totals: _Totals) -> AuditOutcome:
        """The round's audit (of the last fragment's reducers); an audit that breaks here never
        fails the round."""
        audit = AuditOutcome()
        try:
            audit = await self._audit_round(group_id, room, starts)  # type: ignore[attr-defined]
        except Exception:
            logger.exception("audit of this round failed here; nobody is judged")
        for peer, reason in audit.caught.items():
            totals.offences[peer] = f"audit: its average is wrong: {reason}"
        return audit

    def _finish_round(
        self,
        group_id: bytes,
        group_info: GroupInfo,
        started: float,
        round_: int,
        update: PendingUpdate | None,
        totals: _Totals,
        audit: AuditOutcome,
    ) -> None:
        left_out = sum(hi - lo for lo, hi in totals.missing)
        if left_out >= self.numel:
            raise RoundFailedError(f"no averaged part arrived: {totals.failed}")
        for peer, reason in totals.failed.items():
            if peer != str(self.peer_id):  # type: ignore[attr-defined]
                totals.offences.setdefault(peer, f"reducer failed: {reason}")
        if totals.missing:
            logger.warning(
                "round completed without the ranges of reducers %s (%.1f%% of the vector left out of this round)",
                sorted(totals.failed),
                100.0 * left_out / max(1, self.numel),
            )
        # kept with the ranges it left out, which the host states when the round lands
        self._spool_update(round_, update)  # type: ignore[attr-defined]
        self._stats[group_id] = AllReduceStats(
            bytes_sent=totals.bytes_sent,
            bytes_received=totals.bytes_received,
            refused_senders=totals.refused,
            offences=totals.offences,
            allreduce_s=time.monotonic() - started,
            peer_ids=[str(p) for p in group_info.peer_ids],
            streams=totals.streams,
            missing=sorted(totals.missing),
            left_out=sorted(audit.left_out),
            audit_s=audit.seconds,
            audit_bytes=audit.bytes_received,
            receipts=totals.receipts,
            over_bulk=sorted(totals.over_bulk or ()),
        )
        # the round's parts, frames and buffers are garbage now: their pages go back
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
        return ReceiptSigner(self._receipt_identity, run=self.prefix, round_=round_ + 1, ids=ids)  # type: ignore[attr-defined]

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
        *,
        keep_sent: bool = False,
    ) -> ExactAllReduceRunner:
        runner = self.runner_class(  # type: ignore[attr-defined]
            codec=codec,
            receipts=signer,
            bulk=self.bulk_pool(),  # type: ignore[attr-defined]
            stale=stale,
            robust=self.robust,  # type: ignore[attr-defined]
            keep_sent=keep_sent,
            spill=self.update_store.directory if self.update_store is not None else None,  # type: ignore[attr-defined]
            keep_averaged=update.at(start) if update is not None else None,
            p2p=self._p2p,  # type: ignore[attr-defined]
            servicer_type=type(self),
            prefix=self.prefix,  # type: ignore[attr-defined]
            tensors=[fragment],
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        future = self._running_groups.get(group_id)  # type: ignore[attr-defined]
        assert future is not None, "group must be registered before all-reduce"
        future.set_result(runner)
        return runner

    async def _run_fragment(self, runner: ExactAllReduceRunner, group_info: GroupInfo) -> None:
        """One fragment's all-reduce; its averaged parts land in the fragment (``InPlaceOutputs``)."""
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:  # type: ignore[attr-defined]
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        async for _ in runner:
            pass
        await self._serve_in_background(runner)  # type: ignore[attr-defined]  # the senders' last parts: beside the next work
        if self.peer_id in runner.failed_reducers:  # type: ignore[attr-defined]
            # this peer's own parts failed here (a local fault): the others may hold its range
            raise RoundFailedError(f"this peer could not average its own parts: {runner.failed_reducers[self.peer_id]}")  # type: ignore[attr-defined]
