"""Audits inside the averager process (``engine.audit`` says what and why): after a group's
all-reduce, each member re-computes one part of the reducer it audits from the senders' own
copies, tells every other member its verdict, re-checks the accusations it hears, and leaves a
reducer caught lying out of the round (its ranges land as a failed reducer's would, the same
in every member that caught it) and out of its groups for the rest of the run.

Mixed into ``engine.averager.ExactAverager``. Two handlers, for members of the group only:
``rpc_audit_part`` (a part this peer sent a reducer, as it sent it) and ``rpc_audit_verdict``
(a member's accusation, or that it has none: one per member and group, the first counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from engine.allreduce import MAX_WEIGHT, ExactAllReduceRunner, InPlaceOutputs
from engine.audit import AuditTarget, auditee, choose_target, judge, leave_out_candidates, reduce_like_a_reducer
from engine.robust import RobustRule
from engine.wire_fields import read_fields
from protocol.errors import MalformedTensorError

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256
"""An audit request or verdict is a few small fields (serialized into the message's ``peer_id``)."""
UNSERVED = b"unserved"
"""Marks a part served for an audit whose reducer served its sender no average (it gave up on
the sender's parts, or the stream broke): in the reply's spare ``peer_id`` field."""
NO_VERDICT_S = 2.0
"""How long a peer whose all-reduce failed tries to tell the others it judges nothing."""


def _indices(values: Sequence[Any]) -> bool:
    """Whether every value is a plain int in ``[0, 2**31)`` (no bool, no float)."""
    return all(type(value) is int and 0 <= value < 2**31 for value in values)


@dataclass(frozen=True)
class Verdict:
    """One member's audit of one round: whom it caught lying (None: nobody) and where."""

    accused: str | None
    target: AuditTarget | None


@dataclass
class AuditRoom:
    """One group's all-reduce, kept for its audits until this peer's next group begins."""

    peer_ids: tuple[PeerID, ...]
    runners: list[ExactAllReduceRunner]
    stale: frozenset[PeerID]
    verdicts: dict[PeerID, Verdict] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    requests: dict[PeerID, int] = field(default_factory=dict)

    def quota(self) -> int:
        """Part requests a member may make: its own audit and a re-check of each accusation."""
        return 2 * len(self.peer_ids) * max(1, len(self.runners))


@dataclass
class AuditOutcome:
    """What this peer's audits of a round found."""

    caught: dict[str, str] = field(default_factory=dict)
    """Reducers (libp2p id) caught returning a wrong average, with why."""
    left_out: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` ranges of the vector they reduced: left out of this round."""
    seconds: float = 0.0
    bytes_received: int = 0


class AuditMixin:
    """Serves a group's members the parts this peer sent, audits one reducer per round and
    leaves liars out. The averager sets ``audit``, ``robust`` and ``numel`` and calls
    ``_open_audit_room`` as its all-reduce begins and ``_audit_round`` once it ended."""

    audit: bool
    robust: RobustRule
    peer_id: PeerID
    serializer: Any
    client_mode: bool
    _p2p: Any
    prefix: str
    allreduce_kwargs: dict[str, Any]

    def _audit_state(self) -> tuple[dict[bytes, AuditRoom], dict[bytes, tuple[AuditRoom, int]], set[str]]:
        state = self.__dict__.setdefault("_audit", ({}, {}, set()))
        return state

    @property
    def distrusted(self) -> set[str]:
        """Members (libp2p id) this peer caught lying as reducers: never grouped with again."""
        return self._audit_state()[2]

    async def _admitted(self, peer: PeerID, *, stale_ok: bool = False) -> bool:
        """Whom the averager groups with: never a reducer this peer caught lying, else as the
        run's gate says (``engine.averager_gate``)."""
        if str(peer) in self.distrusted:
            return False
        return bool(await super()._admitted(peer, stale_ok=stale_ok))  # type: ignore[misc]

    def _open_audit_room(
        self, group_id: bytes, fragment_ids: Sequence[bytes], peer_ids: Sequence[PeerID], stale: frozenset[PeerID]
    ) -> AuditRoom:
        """A room for this group's audits; the previous group's (and what it kept) is dropped."""
        rooms, fragments, _ = self._audit_state()
        rooms.clear()
        fragments.clear()
        room = AuditRoom(tuple(peer_ids), [], stale)
        rooms[group_id] = room
        for index, fragment_id in enumerate(fragment_ids):
            fragments[fragment_id] = (room, index)
        return room

    def _drop_audit_room(self, group_id: bytes) -> None:
        rooms, fragments, _ = self._audit_state()
        room = rooms.pop(group_id, None)
        if room is not None:
            for key in [key for key, (held, _) in fragments.items() if held is room]:
                fragments.pop(key, None)

    async def rpc_audit_part(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A part this peer sent a reducer in a fragment of a group the requester belongs to
        (in ``peer_id``, which hivemind's message has spare: the reducer's and the part's index), as sent, with its weight."""
        _, fragments, _ = self._audit_state()
        found = fragments.get(request.group_id)
        if found is None:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        room, index = found
        if context.remote_id not in room.peer_ids or index >= len(room.runners):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        room.requests[context.remote_id] = room.requests.get(context.remote_id, 0) + 1
        if room.requests[context.remote_id] > room.quota():
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        position = self._parse_ints(request.peer_id, 2)
        sent = room.runners[index].sent
        kept = sent.get(*position) if position is not None and sent is not None else None
        if kept is None or position is None or position[0] >= len(room.peer_ids):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        encoded, weight = kept
        # not served *yet* counts as not served: the reducer may have given up on this peer's
        # parts while its average to this peer times out later (the churn lab's auditors asked
        # a second before those timeouts, were told "served", and convicted honest reducers)
        unserved = not room.runners[index].holds_average_of(room.peer_ids[position[0]])
        return averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING,
            tensor_part=encoded,
            weight=weight,
            peer_id=UNSERVED if unserved else b"",
        )

    async def rpc_audit_verdict(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A member's verdict on this group (in ``peer_id``: ``[accused peer id or "",
        fragment, reducer, part]``); its first counts."""
        rooms, _, _ = self._audit_state()
        room = rooms.get(request.group_id)
        if room is None:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        if context.remote_id not in room.peer_ids:
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        verdict = self._parse_verdict(request.peer_id, room)
        if verdict is None:
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        if context.remote_id not in room.verdicts:
            room.verdicts[context.remote_id] = verdict
            room.changed.set()
        return averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE)

    def _fields(self, raw: bytes, count: int) -> list[Any] | None:
        """The ``count`` fields serialized in ``raw`` (at most ``MAX_REQUEST_BYTES``); None if not."""
        return read_fields(self.serializer, raw, count, MAX_REQUEST_BYTES)

    def _parse_ints(self, raw: bytes, count: int) -> tuple[int, ...] | None:
        values = self._fields(raw, count)
        return tuple(values) if values is not None and _indices(values) else None

    def _parse_verdict(self, raw: bytes, room: AuditRoom) -> Verdict | None:
        values = self._fields(raw, 4)
        if values is None or not isinstance(values[0], str) or not _indices(values[1:]):
            return None
        accused, numbers = values[0], values[1:]
        if not accused:
            return Verdict(None, None)
        members = {str(peer): index for index, peer in enumerate(room.peer_ids)}
        fragment, reducer, part = numbers
        if members.get(accused) != reducer or fragment >= len(room.runners):
            return None
        return Verdict(accused, AuditTarget(fragment, reducer, part))

    async def _audit_round(self, group_id: bytes, room: AuditRoom, fragment_starts: Sequence[int]) -> AuditOutcome:
        """Audit one reducer of this group, exchange verdicts with the other members, re-check
        what they accuse, and return who was caught (and their ranges, absolute)."""
        started = time.monotonic()
        outcome = AuditOutcome()
        deadline = started + float(self.allreduce_kwargs.get("sender_timeout") or 10.0)
        me = room.peer_ids.index(self.peer_id)
        first = room.runners[0]
        reducers = [index for index, fraction in enumerate(first.peer_fractions) if fraction > 0]
        target = None
        reducer = auditee(group_id, me, reducers)
        if reducer is not None and all(room.peer_ids[reducer] not in r.failed_reducers for r in room.runners):
            counts = [r.tensor_part_container.num_parts_by_peer[reducer] for r in room.runners]
            target = choose_target(reducer, counts)
        own: str | None = None
        if target is not None:
            own = await self._recheck(room, target, deadline, outcome)
        accused = room.peer_ids[target.reducer] if target is not None and own else None
        if accused is not None and target is not None and own:
            outcome.caught[str(accused)] = f"{own} (part {target.part} of fragment {target.fragment})"
        gone = await self._tell_verdict(group_id, room, accused, target, deadline)
        if not self.client_mode:  # nobody can reach a client-mode member: it hears no verdicts
            await self._hear_verdicts(room, deadline, gone)
        checks = {
            verdict.accused: verdict.target
            for peer, verdict in room.verdicts.items()
            if verdict.accused is not None and verdict.target is not None and verdict.accused != str(self.peer_id)
        }
        for suspect, checked in checks.items():
            if suspect in outcome.caught:
                continue
            why = await self._recheck(room, checked, deadline, outcome)
            accusers = sorted(str(peer) for peer, v in room.verdicts.items() if v.accused == suspect)
            if why:
                outcome.caught[suspect] = (
                    f"{why} (part {checked.part} of fragment {checked.fragment}, as {accusers} found)"
                )
            else:
                logger.warning(
                    "audit: %s accused reducer %s; re-checked here: %s",
                    accusers,
                    suspect,
                    "its average is right" if why == "" else "inconclusive",
                )
        for suspect, why in outcome.caught.items():
            index = [str(peer) for peer in room.peer_ids].index(suspect)
            self.distrusted.add(suspect)
            for runner, start in zip(room.runners, fragment_starts):
                container = runner.tensor_part_container
                assert isinstance(container, InPlaceOutputs)
                lo, hi = container.reducer_range(index)
                if lo < hi:
                    outcome.left_out.append((start + lo, start + hi))
            logger.warning(
                "audit: reducer %s returned a wrong average: %s; left out of this round and of later groups",
                suspect,
                why,
            )
        outcome.seconds = time.monotonic() - started
        return outcome

    async def _recheck(
        self, room: AuditRoom, target: AuditTarget, deadline: float, outcome: AuditOutcome
    ) -> str | None:
        """Re-compute ``target`` from the senders' copies and judge the reducer's result (held in
        this peer's vector): why it is wrong, "" if it is right, None if inconclusive (a sender
        other than the reducer did not serve its part)."""
        if not 0 <= target.fragment < len(room.runners):
            return None
        runner = room.runners[target.fragment]
        container = runner.tensor_part_container
        assert isinstance(container, InPlaceOutputs)
        try:
            numel = runner.expected_numel(target.reducer, target.part)
        except MalformedTensorError:
            return "accused of a part it does not reduce"  # only a liar's verdict names one
        reducer_id = room.peer_ids[target.reducer]
        modes = dict(zip(runner.ordered_peer_ids, runner.modes))
        unreachable = [s for s in runner.sender_peer_ids if s != self.peer_id and modes.get(s) == AveragingMode.CLIENT]
        if unreachable:  # nobody can dial a client-mode sender for its part: do not try every round
            logger.debug("audit of %s inconclusive: client-mode senders %s", reducer_id, unreachable)
            return None
        fetched = await asyncio.gather(
            *(self._fetch_part(runner, sender, target, deadline) for sender in runner.sender_peer_ids)
        )
        parts: list[torch.Tensor | None] = []
        weights: list[float] = []
        unserved: set[int] = set()
        loop = asyncio.get_running_loop()
        for index, (sender, got) in enumerate(zip(runner.sender_peer_ids, fetched)):
            if got is None:
                if sender == reducer_id:
                    return "it did not serve its own part for the audit"
                logger.info("audit of %s inconclusive: %s did not serve its part", reducer_id, sender)
                return None
            encoded, weight, not_averaged = got
            if not_averaged and sender != reducer_id:
                unserved.add(index)
            if sender != self.peer_id:
                outcome.bytes_received += len(encoded.buffer)
            try:
                part = await loop.run_in_executor(None, runner.codec.decode_sent, encoded, numel)
            except MalformedTensorError:
                part = None  # the reducer refused it too
            if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
                part = None
            parts.append(part)
            weights.append(0.0 if sender in room.stale else float(weight))
        lo, hi = container.part_range(target.reducer, target.part)
        returned = container.output[lo:hi]
        shape = returned.shape
        dither = runner.dither()
        why = ""
        for leave_out in leave_out_candidates(len(parts), unserved):
            if time.monotonic() > deadline:  # not every candidate tried: no conviction on that
                logger.info("audit of %s inconclusive: out of time re-computing it", reducer_id)
                return None
            mean = reduce_like_a_reducer(parts, weights, self.robust, leave_out)
            if mean is None:
                continue
            encode = runner.codec.compress_sent_average  # as the reducer encodes its mean
            encoded_mean = await loop.run_in_executor(None, encode, mean, list(shape), dither)
            expected = await loop.run_in_executor(None, runner.codec.decode, encoded_mean, numel)
            found = judge(returned, expected)
            if not found:
                return ""
            why = why or found
        return why or "no part of it could be re-computed"

    async def _fetch_part(
        self, runner: ExactAllReduceRunner, sender: PeerID, target: AuditTarget, deadline: float
    ) -> tuple[Any, float, bool] | None:
        """``sender``'s part for ``target`` as it sent it: the part, its weight, and whether the
        reducer served the sender no average; None if it did not serve the part."""
        if sender == self.peer_id:
            kept = runner.sent.get(target.reducer, target.part) if runner.sent is not None else None
            if kept is None:
                return None
            reducer = runner.ordered_peer_ids[target.reducer]
            return kept[0], kept[1], not runner.holds_average_of(reducer)
        request = averaging_pb2.AveragingData(
            group_id=runner.group_id, peer_id=self.serializer.dumps([target.reducer, target.part])
        )
        try:
            stub = type(self).get_stub(self._p2p, sender, namespace=self.prefix)  # type: ignore[attr-defined]
            reply = await stub.rpc_audit_part(request, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - any failure to serve is "not served"
            logger.debug("audit: %s did not serve part %s: %s", sender, target, exc)
            return None
        if reply.code != averaging_pb2.PART_FOR_AVERAGING:
            return None
        return reply.tensor_part, float(reply.weight), reply.peer_id == UNSERVED

    async def _tell_verdict(
        self,
        group_id: bytes,
        room: AuditRoom,
        accused: PeerID | None,
        target: AuditTarget | None,
        deadline: float,
    ) -> set[PeerID]:
        """Send this peer's verdict to every other member that can be dialled; the members the
        call failed for (gone since the all-reduce, say: a peer killed mid-landing), whose
        verdicts nobody need wait for."""
        fields = (
            [str(accused), target.fragment, target.reducer, target.part]
            if accused is not None and target is not None
            else ["", 0, 0, 0]
        )
        message = averaging_pb2.AveragingData(group_id=group_id, peer_id=self.serializer.dumps(fields))

        gone: set[PeerID] = set()

        async def tell(peer: PeerID) -> None:
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)  # type: ignore[attr-defined]
                await stub.rpc_audit_verdict(message, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - any failure: it hears nothing, says nothing
                logger.debug("audit: could not tell %s this peer's verdict: %s", peer, exc)
                gone.add(peer)

        runner = room.runners[0]
        clients = {peer for peer, mode in zip(runner.ordered_peer_ids, runner.modes) if mode == AveragingMode.CLIENT}
        # nobody can dial a client-mode member, and it waits for no verdict
        await asyncio.gather(*(tell(peer) for peer in room.peer_ids if peer != self.peer_id and peer not in clients))
        return gone

    async def _tell_no_verdict(self, group_id: bytes, room: AuditRoom) -> None:
        """Tell the group this peer judges nothing this round (its all-reduce failed here)."""
        await self._tell_verdict(group_id, room, None, None, time.monotonic() + NO_VERDICT_S)

    async def _hear_verdicts(self, room: AuditRoom, deadline: float, gone: set[PeerID]) -> None:
        """Wait until every other member's verdict is here (auxiliary members audit nothing; a
        reducer that failed this peer, or a member this peer could not tell its own verdict, is
        gone), or the deadline."""
        runner = room.runners[0]
        failed = {peer for runner in room.runners for peer in runner.failed_reducers}
        aux = {peer for peer, mode in zip(runner.ordered_peer_ids, runner.modes) if mode == AveragingMode.AUX}
        expected = set(room.peer_ids) - {self.peer_id} - failed - aux - gone
        while not expected <= set(room.verdicts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.info("audit: no verdict from %s in time", sorted(map(str, expected - set(room.verdicts))))
                return
            room.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.changed.wait(), remaining)
