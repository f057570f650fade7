"""Swarm all-reduce on hivemind that leaves every participant with the same bytes.

hivemind's butterfly all-reduce splits the vector into parts; peer ``i`` reduces part ``i``
and returns to each sender ``averaged - sent``, which the sender *adds* to its own copy.
Rounding in those deltas (and in their compression) leaves replicas apart (~2e-7 even
uncompressed, ~3e-3 with fp16). ``ExactAllReduceRunner`` changes the return path: the
reducer encodes its averaged part **once** with the run's codec and sends the *same bytes*
to every sender (itself included), and every peer writes the decoded part in place of its
own. Since decoding is a pure function of the bytes (``engine.compression``), all peers
end with bit-identical averages whatever the codec. The reducer rounds the average
*stochastically* (``Codec.encode_unbiased``, seeded by the group and part): nobody carries
that leg's rounding error into the next round (the senders' leg has error feedback), so it
must be zero in expectation; rounding to nearest would drop every value below half a
quantization step of its block, every round. Each averaged part is written straight into
the vector being averaged (``InPlaceOutputs``): no copies of the vector in the averager.

It also validates what it receives: a part that does not decode (wrong size, NaN/Inf,
bad scales) or a non-finite/non-positive weight gets the sender excluded from the average
with a logged reason. A reducer that sends no averaged parts, stops halfway or sends parts
that do not decode does not fail the round: its whole range is *missing*
(``ExactAllReduceRunner.missing_ranges``), the rest of the vector holds the average, and the
caller leaves the missing ranges out of this round (``peer.round.host_passes.land_round``). Every
member that lost that reducer leaves out the same range, so replicas stay identical.

Which members count is decided before the all-reduce from what they gathered
(``stale_members``, by ``protocol.agreement``). ``engine.averager.ExactAverager`` runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished

from engine.audit import SentParts
from engine.averaged_encodings import AveragedEncodings
from engine.bulk_client import BulkPool
from engine.compression import Codec
from engine.part_buffers import PartBuffers
from engine.receipts import ReceiptSigner, attach, taken
from engine.robust import Alignment, RobustRule, robust_mean
from engine.stream_close import until_reader_closes
from protocol.agreement import Vote, agreed_state
from protocol.errors import MalformedTensorError
from protocol.gathered import Gathered, votes

logger = logging.getLogger(__name__)
T = TypeVar("T")

DTYPE_PREFIX = "swarmtrain:"
PART_SIZE_BYTES = 2**20
"""Largest part on the wire. Chosen by ``benchmarks/allreduce_parts.py``: on loopback here 1 MiB
parts average 2.5x faster than 64 KiB ones (each part costs an executor hop and a message
through p2pd); larger parts gain nothing and cost memory and latency."""
MIN_PART_SIZE_BYTES = 2**16
MAX_PART_VALUES = 2**21
"""A part is at most this many values, whatever its bytes on the wire: a reducer holds every
sender's decoded copy of the part it reduces (``RobustPartReducer``), and a sparse codec's
1 MiB would be 15M values, 60 MB per sender."""
PARTS_PER_PEER = 8
"""Small vectors are cut finer (down to ``MIN_PART_SIZE_BYTES``), so that every member reduces
its share and sending, reducing and returning overlap (a pipeline of parts)."""


def part_size_bytes(numel: int, codec: Codec, group_size: int) -> int:
    """Wire bytes per part for a vector of ``numel`` values averaged by ``group_size`` reducers: a
    whole number of the codec's blocks, the same in every member (it depends only on what they
    share). hivemind cuts the vector into parts of ``part_size_bytes / bytes_per_value`` values
    from its start and hands each part whole to the reducer whose share holds most of it, so
    the part is chosen to cut each reducer's equal share into a whole number of parts: the
    shares then stay equal. A part size that did not divide the share left some reducers a
    part more than others (sparse, a 10.4M-value fragment of 4 members: 2, 3, 2 and 3 parts of
    64 KiB; the two with 3 sent 14% more bytes per round and the round waited for them).

    The size aimed at is what the vector's size asks for (``PARTS_PER_PEER`` parts per share,
    at least ``MIN_PART_SIZE_BYTES`` unless a share is smaller, at most ``PART_SIZE_BYTES`` and
    ``MAX_PART_VALUES``); the share is cut into as many parts as fit at that size or larger,
    rounded up to whole blocks, and into one more only where a part would pass the largest.
    Every member must compute the same size: it is part of the averaging wire (members of
    versions that cut differently refuse each other's parts as mis-sized)."""
    per_value = codec.bytes_per_value()
    block = codec.block
    share = max(1, math.ceil(numel / max(1, group_size)))  # values each reducer averages
    largest = max(block, int(min(PART_SIZE_BYTES / per_value, MAX_PART_VALUES)) // block * block)
    # at least ``MIN_PART_SIZE_BYTES``, unless that leaves fewer parts than reducers: a member
    # with no part reduces nothing, and sees (and bounds) nobody's contribution
    floor = min(MIN_PART_SIZE_BYTES / per_value, share)
    aimed = min(largest, max(floor, share / PARTS_PER_PEER))
    parts = max(1, int(share // aimed))  # parts per share: no part below the aim
    if math.ceil(share / parts / block) * block > largest:
        parts = math.ceil(share / largest)  # unless that part would be too large
    values = max(block, math.ceil(share / parts / block) * block)  # parts start on the codec's blocks
    return int(values * per_value)


MAX_WEIGHT = 1e15
MAX_PART_DIMS = 8
"""A part's shape is flat (one entry); a sender's shape with more entries than this is
refused before any arithmetic on it."""


def part_numel(size: Sequence[int]) -> int:
    """The number of values a part's wire shape ``size`` (a sender's, untrusted) holds. Its
    length and entries are checked first (``MalformedTensorError``): a product over a shape of
    40,000 entries held a reducer's GIL for 12 s (Python's big integers grow with each factor)."""
    if len(size) > MAX_PART_DIMS:
        raise MalformedTensorError(f"tensor part has a shape of {len(size)} dimensions (at most {MAX_PART_DIMS})")
    if any(not 0 <= dim <= MAX_PART_VALUES for dim in size):
        raise MalformedTensorError(f"tensor part has a dimension outside [0, {MAX_PART_VALUES}]: {list(size)}")
    return math.prod(size)


class CodecCompression(CompressionBase):
    """Our codec behind hivemind's compression interface (marks parts with its own dtype)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.dtype_tag = DTYPE_PREFIX + codec.name

    def at_round(self, round_: int) -> CodecCompression:
        """This compression with its codec bound to round ``round_`` (``Codec.at_round``): a
        copy of the same class, so that a subclass's behaviour carries over."""
        bound = copy.copy(self)
        bound.codec = self.codec.at_round(round_)
        return bound

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        return runtime_pb2.Tensor(buffer=self.codec.encode(flat), size=list(tensor.shape), dtype=self.dtype_tag)

    def compress_average(self, tensor: torch.Tensor, dither: torch.Tensor) -> runtime_pb2.Tensor:
        """The reducer's encoding of an averaged part: unbiased (``Codec.encode_unbiased``),
        since nobody carries its rounding error into the next round."""
        flat = tensor.detach().reshape(-1).to(torch.float32)
        buffer = self.codec.encode_unbiased(flat, dither)
        return runtime_pb2.Tensor(buffer=buffer, size=list(tensor.shape), dtype=self.dtype_tag)

    def compress_sent_average(
        self, values: torch.Tensor, shape: Sequence[int], dither: torch.Tensor
    ) -> runtime_pb2.Tensor:
        """``compress_average`` of the part of ``shape`` whose sent values (``decode_sent``'s
        layout) are ``values``: the same bytes."""
        numel = math.prod(shape)
        flat = values.detach().reshape(-1).to(torch.float32)
        buffer = self.codec.encode_sent_unbiased(flat, numel, dither)
        return runtime_pb2.Tensor(buffer=buffer, size=list(shape), dtype=self.dtype_tag)

    def encode_averaged(self, averaged: torch.Tensor, numel: int, dither: torch.Tensor) -> runtime_pb2.Tensor:
        """A reducer's averaged part of ``numel`` values: dense (``compress_average``; every
        sender failed before it, zeros) or its sent values alone (``compress_sent_average``)."""
        if averaged.numel() == numel:
            return self.compress_average(averaged, dither)
        return self.compress_sent_average(averaged, [numel], dither)

    def decode_sent(self, serialized: runtime_pb2.Tensor, expected_numel: int) -> torch.Tensor:
        """The values a reducer averages of a part (``Codec.decode_sent``), validated as ``decode`` does."""
        self._check_part(serialized, expected_numel)
        return self.codec.decode_sent(serialized.buffer, expected_numel)

    def decode_sent_into(self, serialized: runtime_pb2.Tensor, expected_numel: int, out: torch.Tensor) -> None:
        """``decode_sent`` written into ``out`` (``Codec.decode_sent_into``), validated alike."""
        self._check_part(serialized, expected_numel)
        self.codec.decode_sent_into(serialized.buffer, expected_numel, out)

    def decode_sent_reused(
        self, buffers: PartBuffers, serialized: runtime_pb2.Tensor, expected_numel: int
    ) -> torch.Tensor:
        """``decode_sent`` into a buffer of ``buffers`` (``PartBuffers.decoded``), validated alike."""
        numel = self.codec.sent_numel(expected_numel)
        return buffers.decoded(numel, partial(self.decode_sent_into, serialized, expected_numel))

    def _check_part(self, serialized: runtime_pb2.Tensor, expected_numel: int | None) -> int:
        if serialized.dtype != self.dtype_tag:
            raise MalformedTensorError(f"tensor part encoded as {serialized.dtype!r}, expected {self.dtype_tag!r}")
        numel = part_numel(serialized.size)
        if expected_numel is not None and numel != expected_numel:
            raise MalformedTensorError(f"tensor part has {numel} values, expected {expected_numel}")
        return numel

    def decode_into(self, serialized: runtime_pb2.Tensor, out: torch.Tensor) -> None:
        """``decode`` of a part of ``out``'s length written into ``out`` (``Codec.decode_into``:
        no fresh tensor and copy); on ``MalformedTensorError`` ``out`` holds garbage."""
        self._check_part(serialized, out.numel())
        self.codec.decode_into(serialized.buffer, out)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.decode(serialized_tensor, expected_numel=None)

    def decode(self, serialized: runtime_pb2.Tensor, expected_numel: int | None) -> torch.Tensor:
        """Decode and validate; raises ``MalformedTensorError`` naming what is wrong."""
        numel = self._check_part(serialized, expected_numel)
        return self.codec.decode(serialized.buffer, numel)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.bytes_per_value() / 4.0


class InPlaceOutputs(TensorPartContainer):
    """hivemind's part container, but each averaged part is written straight into the vector
    being averaged as it arrives (hivemind keeps every part, then concatenates them: two more
    copies of the whole vector in the averager's process). The caller's vector therefore holds
    a mix of sent and averaged values until every part arrived or its reducer failed, and
    garbage in a failed reducer's range (``reducer_range``): the host never reads those.

    Writing a part in place is safe: a reducer returns averaged part ``k`` only after it has
    received this peer's part ``k``, which was encoded (copied into a message) before it was
    sent, and this peer's own parts are accumulated (copied) before their average is written.
    """

    _outputs_consumed: bool

    def __init__(self, tensors: list[torch.Tensor], peer_fractions: Any, **kwargs: Any) -> None:
        super().__init__(tensors, peer_fractions, **kwargs)
        if len(tensors) != 1:
            raise ValueError("the exact all-reduce averages one flat vector")
        self.output = tensors[0].view(-1)
        self._offsets: list[list[int]] = []
        self._ranges: list[tuple[int, int]] = []
        offset = 0
        for peer_parts in self._input_parts_by_peer:
            starts = []
            first = offset
            for part, _info in peer_parts:
                starts.append(offset)
                offset += part.numel()
            starts.append(offset)  # the end of its last part
            self._offsets.append(starts)
            self._ranges.append((first, offset))
        self._registered = 0
        self._all_registered = asyncio.Event()

    @classmethod
    def replacing(
        cls, hivemind_container: TensorPartContainer, kwargs: dict[str, Any], codec: CodecCompression, part_bytes: int
    ) -> InPlaceOutputs:
        """The same split as hivemind's container (of an ``AllReduceRunner`` built with
        ``kwargs``), which is finalized unused: its averaged parts go straight into the vector."""
        hivemind_container.finalize()
        tensors, fractions = list(kwargs["tensors"]), kwargs["peer_fractions"]
        return cls(tensors, fractions, compression=codec, part_size_bytes=part_bytes, return_deltas=False)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        self.output_of(peer_index, part_index).copy_(part.view(-1))
        self.register_written_part(peer_index, part_index)

    def output_of(self, peer_index: int, part_index: int) -> torch.Tensor:
        """Where reducer ``peer_index``'s averaged part ``part_index`` goes: its range of the
        vector, to decode into (``register_written_part`` once it holds the part); ``ValueError``
        for a part that is not the next one of that reducer."""
        if part_index != self._outputs_registered_by_peer[peer_index]:
            raise ValueError(f"part #{part_index} of peer #{peer_index} out of order")
        start, end = self._offsets[peer_index][part_index], self._offsets[peer_index][part_index + 1]
        return self.output[start:end]

    async def decode_part(self, peer_index: int, part_index: int, decode_into: Callable[[torch.Tensor], None]) -> None:
        """``decode_into(range)`` on an executor's thread, straight into reducer ``peer_index``'s
        part ``part_index``'s range of the vector (no part-sized tensor, no copy: the decode is
        the one pass over it). A part that does not decode leaves garbage there, which its
        reducer's failure then leaves out; a round cancelled meanwhile lets go of the vector only
        once the decode is done (``ended_before_cancel``)."""
        out = self.output_of(peer_index, part_index)
        await ended_before_cancel(asyncio.get_running_loop().run_in_executor(None, decode_into, out))

    def register_written_part(self, peer_index: int, part_index: int) -> None:
        """``output_of(peer_index, part_index)`` holds the averaged part now."""
        start, end = self.part_range(peer_index, part_index)
        if part_index != self._outputs_registered_by_peer[peer_index]:
            raise ValueError(f"part #{part_index} of peer #{peer_index} out of order")
        self._outputs_registered_by_peer[peer_index] += 1
        self._registered += end - start
        if self._registered + self.failed_size >= self.total_size:
            self._all_registered.set()

    def register_failed_reducer(self, peer_index: int) -> None:
        """Reducer ``peer_index`` will send no more averaged parts: stop waiting for them. Its
        whole range (``reducer_range``) is then missing, the parts that did arrive included."""
        registered = self._outputs_registered_by_peer[peer_index]
        start, end = self._ranges[peer_index]
        done = self._offsets[peer_index][registered] - start  # its end once all arrived
        self.failed_size += end - start - done
        self._outputs_registered_by_peer[peer_index] = self.num_parts_by_peer[peer_index]
        if self._registered + self.failed_size >= self.total_size:
            self._all_registered.set()

    def reducer_range(self, peer_index: int) -> tuple[int, int]:
        """``[start, end)`` of the vector that reducer ``peer_index`` averages."""
        return self._ranges[peer_index]

    def part_range(self, peer_index: int, part_index: int) -> tuple[int, int]:
        """``[start, end)`` of reducer ``peer_index``'s part ``part_index`` in the vector."""
        if not 0 <= part_index < len(self._offsets[peer_index]) - 1:
            raise IndexError(f"reducer #{peer_index} has no part #{part_index}")
        return self._offsets[peer_index][part_index], self._offsets[peer_index][part_index + 1]

    async def iterate_output_tensors(self) -> AsyncIterator[torch.Tensor]:
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        finished = asyncio.ensure_future(self.finished.wait())
        registered = asyncio.ensure_future(self._all_registered.wait())
        try:
            await asyncio.wait({finished, registered}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
            registered.cancel()
        if not self._all_registered.is_set():
            raise AllreduceException("All-reduce was terminated during iteration")
        yield self.local_tensors[0]


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer, but it keeps every sender's copy of the part being reduced and, once
    all arrived, averages them with ``engine.robust.robust_mean`` (hivemind adds each copy to
    a running sum as it arrives, so nothing can be bounded against the others). Holds one part
    per sender at a time. Senders named for a weight or norm are in ``offences`` (sender
    index: the first reason, and in how many parts); ``alignment`` pools each sender's
    direction against the others' over this reducer's parts (the averager pools it over
    every fragment's reducer before judging it, ``engine.robust.direction_offence``)."""

    current_part_future: asyncio.Future[torch.Tensor]

    def __init__(
        self, part_shapes: Any, num_senders: int, rule: RobustRule, buffers: PartBuffers | None = None
    ) -> None:
        self.rule = rule
        self.buffers = buffers
        """Where the senders' decoded parts came from: they go back once their part is reduced."""
        self._parts: dict[int, tuple[torch.Tensor, float]] = {}
        self.offences: dict[int, str] = {}
        self.offence_counts: dict[int, int] = {}
        self.alignment: dict[int, Alignment] = {}
        super().__init__(part_shapes, num_senders)

    def named(self) -> dict[int, str]:
        """Senders (by index) this reducer names for their weight or norm, with why."""
        return {
            sender: f"{reason} (in {self.offence_counts[sender]} of {self.num_parts} parts)"
            for sender, reason in self.offences.items()
        }

    def reset_accumulators(self) -> None:
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            if self.buffers is not None:
                self.buffers.clear()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self._parts = {}

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Keep the sender's copy of part ``part_index``; once every current sender's copy is
        here, the robust mean of them all (the same tensor for every sender)."""
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"no part #{part_index} of sender #{sender_index} in this group")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            finished = asyncio.ensure_future(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"part #{part_index} arrived after the reducer finished")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was excluded from this round")
        if part_index != self.current_part_index or sender_index in self._parts:
            raise AllreduceException(f"part #{part_index} of sender #{sender_index} out of order")
        future = self.current_part_future
        self._parts[sender_index] = (tensor_part, weight)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await _shared_result(future, f"part #{part_index}")

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        senders = sorted(self._parts)
        if not senders:  # every sender failed before this part: nobody waits for it
            self.current_part_future.set_result(torch.zeros(self.part_shapes[self.current_part_index]))
            self.reset_accumulators()
            return
        reduced = robust_mean([self._parts[i][0] for i in senders], [self._parts[i][1] for i in senders], self.rule)
        for position, reason in reduced.offences.items():
            sender = senders[position]
            self.offences.setdefault(sender, reason)
            self.offence_counts[sender] = self.offence_counts.get(sender, 0) + 1
        for position, seen in reduced.alignment.items():
            self.alignment.setdefault(senders[position], Alignment()).add(seen)
        if self.buffers is not None:
            self.buffers.give(part for part, _weight in self._parts.values())
        self.current_part_future.set_result(reduced.mean)
        self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose reducers broadcast one encoding of each averaged part."""

    tensor_part_container: TensorPartContainer

    def __init__(
        self,
        *,
        codec: CodecCompression,
        stale: frozenset[PeerID] = frozenset(),
        robust: RobustRule | None = None,
        keep_sent: bool = False,
        spill: Path | None = None,
        keep_averaged: Callable[[int, runtime_pb2.Tensor], None] | None = None,
        receipts: ReceiptSigner | None = None,
        bulk: BulkPool | None = None,
        **kwargs: Any,
    ) -> None:
        numel = sum(t.numel() for t in kwargs["tensors"])
        reducers = sum(1 for fraction in kwargs["peer_fractions"] if fraction > 0)
        part_bytes = part_size_bytes(numel, codec.codec, reducers or len(kwargs["ordered_peer_ids"]))
        super().__init__(compression=codec, part_size_bytes=part_bytes, **kwargs)
        container = InPlaceOutputs.replacing(self.tensor_part_container, kwargs, codec, part_bytes)
        self.tensor_part_container = container
        my_index = self.ordered_peer_ids.index(self.peer_id)
        self.parts_for_local_averaging = container.get_raw_input_parts(my_index)
        # hivemind's reducer is replaced unused: marked finished, so that its finalizer does not
        # log "Reducer: received 0.0% of input tensors" once per fragment per round
        hivemind_reducer: TensorPartReducer = self.tensor_part_reducer
        hivemind_reducer.finished.set()
        self._buffers = PartBuffers()
        self.tensor_part_reducer: TensorPartReducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            robust if robust is not None else RobustRule.off(),
            self._buffers,
        )
        self.codec = codec
        self.stale = stale
        """Members that started the round from another state than the group's majority: their
        parts count with weight 0 (they still get the average, see it differs, and re-sync)."""
        self._encoded = AveragedEncodings()
        self._served: set[PeerID] = set()
        """Senders whose stream to this reducer ended (served, refused or excluded)."""
        self._served_changed = asyncio.Event()
        self._dither_values: torch.Tensor | None = None
        self._received_all: dict[int, asyncio.Event] = {}
        """Per reducer (index): set once this peer holds all its averaged parts or gave up."""
        self.failed_reducers: dict[PeerID, str] = {}
        """Reducers this peer got no complete, valid set of averaged parts from, with why: their
        ranges are left out of this round (``missing_ranges``)."""
        self.refused_senders: dict[PeerID, str] = {}
        self.sent: SentParts | None = SentParts(spill) if keep_sent else None
        """With ``keep_sent``: every part this peer sent a reducer (its own included), as
        encoded, for the group's auditors (``engine.audit``)."""
        self.keep_averaged = keep_averaged
        """Called (on a thread) with every averaged part this peer takes (its start in this runner's
        vector, its bytes as the reducer encoded them): the round's update, which members keep for
        newcomers (``engine.update_store``); None: nobody keeps it."""
        self.signer = receipts
        """Signs this reducer's receipt for each sender (``engine.receipts``); None: it sends none."""
        self.receipts: dict[PeerID, bytes] = {}
        """Each reducer's receipt for this peer's parts, as it came with its last averaged part."""
        self.bulk = bulk
        """Connections to reducers beside libp2p (``engine.bulk_channel``); None: libp2p only."""
        self.over_bulk: set[PeerID] = set()
        """Reducers this peer's parts went to over the bulk channel (the others: libp2p)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        # sizes of every part in global order (peer 0's parts, then peer 1's, ...)
        self._part_numels = [
            part.numel() for peer_parts in self.tensor_part_container._input_parts_by_peer for part, _ in peer_parts
        ]

    def served_all(self) -> None:
        """Every sender took its averaged parts, or never will: their encodings are freed."""
        self._encoded.clear()

    def holds_average_of(self, peer_id: PeerID) -> bool:
        """Whether this peer holds every averaged part of reducer ``peer_id``: False while they
        are still on their way, as when they never came (what it tells an auditor: an average
        that has not arrived yet may never arrive, and that reducer may have dropped this peer's
        parts; ``engine.audit``)."""
        done = self._received_all.get(self.ordered_peer_ids.index(peer_id))
        return done is not None and done.is_set() and peer_id not in self.failed_reducers

    def missing_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of this runner's vector whose average this peer does not hold:
        those of the reducers in ``failed_reducers``, each whole (parts of it that did arrive
        included, so that every member that lost the reducer leaves out the same values)."""
        container = self.tensor_part_container
        assert isinstance(container, InPlaceOutputs)
        ranges = [container.reducer_range(self.ordered_peer_ids.index(peer)) for peer in self.failed_reducers]
        return sorted(r for r in ranges if r[0] < r[1])

    @property
    def alignment(self) -> dict[PeerID, Alignment]:
        """Each sender's parts against the others', pooled over this reducer's parts."""
        reducer = self.tensor_part_reducer
        if not isinstance(reducer, RobustPartReducer):
            return {}
        return {self.sender_peer_ids[sender]: seen for sender, seen in reducer.alignment.items()}

    @property
    def offences(self) -> dict[PeerID, str]:
        """Senders this reducer named this round, with the reason: a weight or norm far over
        its bound (``RobustPartReducer``), or a part that did not decode. (Direction is judged
        over every fragment's reducer: ``ExactAverager``.)"""
        reducer = self.tensor_part_reducer
        named: dict[PeerID, str] = {}
        if isinstance(reducer, RobustPartReducer):
            for sender, reason in reducer.named().items():
                named[self.sender_peer_ids[sender]] = reason
        for peer, reason in self.refused_senders.items():
            named[peer] = f"refused: {reason}"
        return named

    def dither(self) -> torch.Tensor:
        """Uniform [0, 1) values for the stochastic rounding of this round's averaged parts:
        drawn once per round (seeded by the group), shared by the parts; each value's rounding
        is unbiased whatever the others'. Empty for a codec whose unbiased encoding reads none
        (``Codec.stochastic``: fp16's is its plain encoding)."""
        if self._dither_values is None and not self.codec.codec.stochastic:
            self._dither_values = torch.empty(0)
        if self._dither_values is None:
            seed = int.from_bytes(hashlib.blake2b(bytes(self.group_id), digest_size=8).digest(), "big")
            longest = max(self._part_numels, default=0) + self.codec.codec.block
            self._dither_values = torch.rand(longest, generator=torch.Generator().manual_seed(seed))
        return self._dither_values

    def expected_numel(self, peer_index: int, part_index: int) -> int:
        """Values in reducer ``peer_index``'s part ``part_index``; ``MalformedTensorError`` if it has none such."""
        parts = self.tensor_part_container.num_parts_by_peer
        if not 0 <= part_index < parts[peer_index]:
            raise MalformedTensorError(f"unexpected part #{part_index} (peer has {parts[peer_index]} parts)")
        first = sum(parts[:peer_index])
        return self._part_numels[first + part_index]

    async def _encode_once(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """The one encoding of averaged part ``part_index`` that every sender gets. It runs in its
        own future, not in the task of whichever sender asked first: that sender's handler may be
        cancelled (its peer died) while the others wait for the same bytes. It is let go once
        every sender took it (``engine.averaged_encodings``)."""
        loop = asyncio.get_running_loop()
        numel = self.expected_numel(self.ordered_peer_ids.index(self.peer_id), part_index)
        encode = self.codec.encode_averaged
        future = self._encoded.future(
            part_index, lambda: loop.run_in_executor(None, encode, averaged, numel, self.dither())
        )
        return await _shared_result(future, f"the encoding of part #{part_index}")

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id != self.peer_id:
            await self._receive_from_reducer(peer_id, peer_index)
            return
        try:
            await self._average_own_parts(peer_index)
        except BaseException as exc:
            self.failed_reducers[peer_id] = f"this peer's own parts: {type(exc).__name__}: {exc}"
            if isinstance(exc, Exception):
                # its reducer still serves the others, without its parts: the round ends here
                # (and the reducer with it) only once the others' parts are reduced
                await self._ban_sender(peer_id)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.tensor_part_reducer.finished.wait(), self.reducer_timeout or 60.0)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _average_own_parts(self, peer_index: int) -> None:
        """Reduce the parts this peer is the reducer of, its own contribution included."""
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_running_loop()
        for part_index, raw_part in enumerate(self.parts_for_local_averaging):
            # our own contribution goes through the codec too, as everyone else's does
            info = CompressionInfo.from_tensor(raw_part)
            sent = await loop.run_in_executor(None, self.codec.compress, raw_part, info)
            if self.sent is not None:
                await loop.run_in_executor(None, self.sent.keep, peer_index, part_index, sent, self.weight)
            part = await loop.run_in_executor(
                None, self.codec.decode_sent_reused, self._buffers, sent, raw_part.numel()
            )
            weight = 0.0 if self.peer_id in self.stale else self.weight
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight=weight)
            encoded = await self._encode_once(part_index, averaged)
            self._encoded.taken(part_index, self.tensor_part_reducer.sender_failed_after)
            await self._write_averaged_part(peer_index, part_index, encoded)

    async def _receive_from_reducer(self, peer_id: PeerID, peer_index: int) -> None:
        """Stream this peer's parts to one reducer and take the averaged parts back.

        The stream closes only once this peer holds every averaged part: its request stream
        ends (``_generate_input_for_peer``) after the last averaged part arrived, and the
        reducer's handler waits for that end. If the reducer closed first, p2pd would reset the
        stream, and a reset drops what the receiving daemon still buffers: on a slow link, the
        last averaged parts."""
        received_all = self._received_all.setdefault(peer_index, asyncio.Event())
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        stream: Any = None
        responses: Any = None
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._open_parts_stream(peer_id, inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            responses = aiter_with_timeout(stream, self.reducer_timeout)
            while part_index < expected:
                msg = await anext(responses, None)
                if msg is None:
                    raise AllreduceException(f"{peer_id} sent {part_index} averaged parts, expected {expected}")
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                await self._take_averaged_part(peer_index, part_index, msg.tensor_part)
                part_index += 1
                if receipt := taken(msg):  # the latest one stands (``_receipt``)
                    self.receipts[peer_id] = receipt
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self.failed_reducers[peer_id] = reason
            if isinstance(exc, Exception):
                logger.warning("averaged part from reducer %s refused or missing: %s", peer_id, reason)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            received_all.set()  # our request stream may end now
            for generator in (responses, stream):
                if generator is not None:
                    with contextlib.suppress(Exception):
                        await generator.aclose()

    async def _open_parts_stream(
        self, peer_id: PeerID, inputs: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The stream of this peer's parts to reducer ``peer_id`` and its averaged parts back: over
        the bulk channel where a direct connection is (or can be) had, else over libp2p."""
        connection = await self.bulk.open(peer_id) if self.bulk is not None else None
        if connection is not None:
            self.over_bulk.add(peer_id)
            return connection.call(inputs)
        stream: AsyncIterator[averaging_pb2.AveragingData] = await self._get_peer_stub(peer_id).rpc_aggregate_part(
            inputs
        )
        return stream

    async def _take_averaged_part(self, peer_index: int, part_index: int, serialized: runtime_pb2.Tensor) -> None:
        """Decode (validating) averaged part ``part_index`` from reducer ``peer_index`` and write it in place."""
        self.expected_numel(peer_index, part_index)
        self.bytes_received += len(serialized.buffer)
        await self._write_averaged_part(peer_index, part_index, serialized)

    async def _write_averaged_part(self, peer_index: int, part_index: int, serialized: runtime_pb2.Tensor) -> None:
        """Decode a part into its range (``InPlaceOutputs.decode_part``), keep it for the updates, count it."""
        container = self.tensor_part_container
        assert isinstance(container, InPlaceOutputs)
        await container.decode_part(peer_index, part_index, partial(self.codec.decode_into, serialized))
        if self.keep_averaged is not None:
            start = container.part_range(peer_index, part_index)[0]
            await asyncio.get_running_loop().run_in_executor(None, self.keep_averaged, start, serialized)
        container.register_written_part(peer_index, part_index)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(message.tensor_part.buffer)
            if self.sent is not None:
                await asyncio.get_running_loop().run_in_executor(
                    None, self.sent.keep, peer_index, part_index, message.tensor_part, message.weight
                )
            part_index += 1
            yield message
        if not self.should_delay_results(self.peer_id):
            # end the request stream only once every averaged part arrived (see _receive_from_reducer);
            # a peer whose results are delayed (client mode) must end it first to get them at all
            await self._received_all.setdefault(peer_index, asyncio.Event()).wait()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler, but the stream of a sender whose results are delayed (client
        mode) ends only once that sender closed it, holding every averaged part
        (``engine.stream_close``: a stream the reducer closed first can be reset before the
        sender's daemon passed on what it buffered). Such a sender ends its request stream
        before it gets anything (``_generate_input_for_peer``), so the full members' rule (the
        request stream ends last) cannot hold for it. With delayed results every averaged part
        leaves in one burst just before the close: a fresh-clone run lost all of one reducer's
        parts to a client-mode member (``test_bad_tensors.py``, 1 run)."""
        sender = context.remote_id
        delayed = sender in self.sender_peer_ids and self.should_delay_results(sender)
        messages = super().rpc_aggregate_part(stream, context)
        try:
            async for message in until_reader_closes(messages) if delayed else messages:
                yield message
        finally:
            if delayed:
                self._served.add(sender)
                self._served_changed.set()

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        loop = asyncio.get_running_loop()
        my_index = self.ordered_peer_ids.index(self.peer_id)
        sender = self.sender_peer_ids[sender_index]
        part_index = 0
        ended = "its stream ended"
        try:
            async for msg in stream:
                try:
                    numel = self.expected_numel(my_index, part_index)
                    self.bytes_received += len(msg.tensor_part.buffer)
                    part = await loop.run_in_executor(
                        None, self.codec.decode_sent_reused, self._buffers, msg.tensor_part, numel
                    )
                    weight = _check_weight(msg.weight)
                    if sender in self.stale:
                        weight = 0.0
                except MalformedTensorError as exc:
                    self.refused_senders[sender] = str(exc)
                    logger.warning("refused part #%d from %s: %s", part_index, sender, exc)
                    raise
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:
                    ended = "it was excluded from this round"
                    break
                encoded = await self._encode_once(part_index, averaged)
                self._encoded.taken(part_index, self.tensor_part_reducer.sender_failed_after)
                part_index += 1
                self.bytes_sent += len(encoded.buffer)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
                if part_index in (1, self.tensor_part_reducer.num_parts):
                    reply = attach(reply, self._receipt(sender, sender_index, weight))
                yield reply
        except BaseException as exc:
            ended = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if not self.should_delay_results(sender):  # a delayed sender is served once it closes
                self._served.add(sender)
                self._served_changed.set()
            if part_index != self.tensor_part_reducer.num_parts:
                logger.warning(
                    "served %s only %d of %d averaged parts: %s",
                    sender,
                    part_index,
                    self.tensor_part_reducer.num_parts,
                    ended,
                )
                await self._ban_sender(sender)

    def _receipt(self, sender: PeerID, sender_index: int, weight: float) -> bytes:
        """This reducer's receipt for ``sender``'s parts (``engine.receipts``), sent with the
        first averaged part (should this peer die before the last, the sender holds its word) and
        again with the last, naming what its reducer bounded of them all; the sender keeps the
        latest."""
        if self.signer is None:
            return b""
        reducer = self.tensor_part_reducer
        named = reducer.named() if isinstance(reducer, RobustPartReducer) else {}
        try:
            return self.signer(sender, weight, named.get(sender_index, ""))
        except Exception:  # a receipt is never worth the round
            logger.exception("could not sign a receipt for %s", sender)
            return b""

    async def wait_until_served(self, timeout: float) -> bool:
        """Wait until every sender that streamed parts to this reducer holds its last averaged
        part (its request stream ended, see ``_receive_from_reducer``, so its handler is done),
        at most ``timeout`` s. This peer's own result can be complete before that: a peer that
        left right then (its last round) cut the others' last averaged parts."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._everyone_served():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            self._served_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._served_changed.wait(), remaining)
        return True

    def _everyone_served(self) -> bool:
        """Whether every other sender's stream to this reducer ended or it was excluded (a
        reducer whose own parts failed at once keeps serving until then)."""
        if self.tensor_part_reducer.num_parts == 0:
            return True
        waiting = set(self.sender_peer_ids) - {self.peer_id} - self.banned_senders - self._served
        return not waiting

    async def _ban_sender(self, peer_id: PeerID) -> None:
        await super()._ban_sender(peer_id)
        self._served_changed.set()


class RoundFailedError(AllreduceException):
    """This peer did not receive every averaged part; its vector was left untouched."""


def stale_members(group_info: GroupInfo, serializer: Any) -> frozenset[PeerID]:
    """Members that did not start the round from the group's agreed state (``protocol.
    agreement``: the strict-majority digest of the newest round a member stated). Every member
    computes the same set from the same gathered bytes. Raises ``RoundFailedError`` when the
    members stated states but agree on none (a tie, e.g. two members of one round with two
    digests): nobody can tell whose pseudo-gradient is the swarm's, so the group averages
    nothing and every member re-checks. Nobody stated a state: nobody is stale."""
    cast = _votes(group_info, serializer)
    if not cast:
        return frozenset()
    agreed = agreed_state(cast)
    if agreed is None:
        raise RoundFailedError(
            "the group's members started from different states and no strict majority agrees on one; not averaging"
        )
    in_sync = {vote.voter for vote in cast if (vote.round, vote.digest) == (agreed.round, agreed.digest)}
    return frozenset(peer for peer in group_info.peer_ids if str(peer) not in in_sync)


def group_round(group_info: GroupInfo, serializer: Any) -> int:
    """The round of the group's agreed state (``stale_members``), which every member binds its
    codec to (``Codec.at_round``): the stale members too, so that their parts have the group's
    wire format. 0 when nobody stated a state or no majority agrees (the round then fails)."""
    cast = _votes(group_info, serializer)
    agreed = agreed_state(cast) if cast else None
    return agreed.round if agreed is not None else 0


def _votes(group_info: GroupInfo, serializer: Any) -> list[Vote]:
    members: list[tuple[str, Gathered | None]] = []
    for peer, raw in zip(group_info.peer_ids, group_info.gathered):
        try:
            _bandwidth, _mode, user_bytes = serializer.loads(raw)
            data = Gathered.parse(serializer.loads(user_bytes))
        except Exception:  # noqa: BLE001 - unreadable gather: no vote
            data = None
        members.append((str(peer), data))
    return votes(members)


async def _shared_result(future: asyncio.Future[Any], what: str) -> Any:
    """Await a future that other tasks await too, without cancelling it for them when this task
    is cancelled: a plain ``await`` hands the cancellation on to the future itself, so one
    sender's handler that is cancelled (its peer's stream broke) would fail the part for every
    other sender and for this peer's own parts. A future cancelled by its owner (the reducer
    finished) is an ``AllreduceException`` naming what never came."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if future.cancelled() and not (task is not None and task.cancelling()):
            raise AllreduceException(f"{what} was abandoned: the reducer finished before it was reduced") from None
        raise


async def ended_before_cancel(work: asyncio.Future[T]) -> T:
    """``work``'s result; cancelled, it raises ``CancelledError`` only once ``work`` ended (an
    executor's thread cannot be stopped: what it writes into, e.g. the averaged vector, stays
    its own until then)."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        raise


def _check_weight(weight: float) -> float:
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise MalformedTensorError(f"averaging weight must be finite and in (0, {MAX_WEIGHT:g}], got {weight!r}")
    return float(weight)
