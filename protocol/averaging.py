"""Swarm all-reduce on hivemind that leaves every participant with the same bytes.

hivemind's butterfly all-reduce splits the vector into parts; peer ``i`` reduces part ``i``
and returns to each sender ``averaged - sent``, which the sender *adds* to its own copy.
Rounding in those deltas (and in their compression) leaves replicas apart (~2e-7 even
uncompressed, ~3e-3 with fp16). ``ExactAllReduceRunner`` changes the return path: the
reducer encodes its averaged part **once** with the run's codec and sends the *same bytes*
to every sender (itself included), and every peer writes the decoded part in place of its
own. Since decoding is a pure function of the bytes (``protocol.compression``), all peers
end with bit-identical averages whatever the codec.

It also validates what it receives: a part that does not decode (wrong size, NaN/Inf,
bad scales) or a non-finite/non-positive weight gets the sender excluded from the average
with a logged reason; an averaged part from a reducer that does not decode fails the round
for this peer (its vector is left untouched) rather than mixing in local values.

``ExactAverager`` is a ``DecentralizedAverager`` (DHT matchmaking, hivemind P2P) that uses
this runner and replaces its single flat tensor with the result only when every part
arrived. The vector averaged is whatever the caller puts in it (a pseudo-gradient).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from protocol.agreement import agreed_state, gathered_votes
from protocol.compression import Codec
from protocol.errors import MalformedTensorError
from protocol.membership import Lookup, MemberGate
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

DTYPE_PREFIX = "swarmtrain:"
PART_SIZE_BYTES = 2**16  # divided by any codec's bytes/value, a multiple of its 64-value block
MAX_WEIGHT = 1e15


class CodecCompression(CompressionBase):
    """Our codec behind hivemind's compression interface (marks parts with its own dtype)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.dtype_tag = DTYPE_PREFIX + codec.name

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        return runtime_pb2.Tensor(buffer=self.codec.encode(flat), size=list(tensor.shape), dtype=self.dtype_tag)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.decode(serialized_tensor, expected_numel=None)

    def decode(self, serialized: runtime_pb2.Tensor, expected_numel: int | None) -> torch.Tensor:
        """Decode and validate; raises ``MalformedTensorError`` naming what is wrong."""
        if serialized.dtype != self.dtype_tag:
            raise MalformedTensorError(f"tensor part encoded as {serialized.dtype!r}, expected {self.dtype_tag!r}")
        numel = math.prod(serialized.size)
        if expected_numel is not None and numel != expected_numel:
            raise MalformedTensorError(f"tensor part has {numel} values, expected {expected_numel}")
        return self.codec.decode(serialized.buffer, numel)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.bytes_per_value() / 4.0


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose reducers broadcast one encoding of each averaged part."""

    def __init__(self, *, codec: CodecCompression, stale: frozenset[PeerID] = frozenset(), **kwargs: Any) -> None:
        super().__init__(compression=codec, part_size_bytes=PART_SIZE_BYTES, **kwargs)
        self.codec = codec
        self.stale = stale
        """Members that started the round from another state than the group's majority: their
        parts count with weight 0 (they still get the average, see it differs, and re-sync)."""
        self._encoded: dict[int, asyncio.Future[runtime_pb2.Tensor]] = {}
        self.failed_reducers: set[PeerID] = set()
        self.refused_senders: dict[PeerID, str] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        # sizes of every part in global order (peer 0's parts, then peer 1's, ...)
        self._part_numels = [
            part.numel() for peer_parts in self.tensor_part_container._input_parts_by_peer for part, _ in peer_parts
        ]

    def _expected_numel(self, peer_index: int, part_index: int) -> int:
        parts = self.tensor_part_container.num_parts_by_peer
        if not 0 <= part_index < parts[peer_index]:
            raise MalformedTensorError(f"unexpected part #{part_index} (peer has {parts[peer_index]} parts)")
        first = sum(parts[:peer_index])
        return self._part_numels[first + part_index]

    async def _encode_once(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        future = self._encoded.get(part_index)
        if future is None:
            future = self._encoded[part_index] = asyncio.get_running_loop().create_future()
            info = CompressionInfo.from_tensor(averaged)
            encoded = await asyncio.get_running_loop().run_in_executor(None, self.codec.compress, averaged, info)
            future.set_result(encoded)
        return await future

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id != self.peer_id:
            await self._receive_from_reducer(peer_id, peer_index)
            return
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_running_loop()
        for part_index, raw_part in enumerate(self.parts_for_local_averaging):
            # our own contribution goes through the codec too, as everyone else's does
            info = CompressionInfo.from_tensor(raw_part)
            sent = await loop.run_in_executor(None, self.codec.compress, raw_part, info)
            part = await loop.run_in_executor(None, self.codec.decode, sent, raw_part.numel())
            weight = 0.0 if self.peer_id in self.stale else self.weight
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight=weight)
            encoded = await self._encode_once(part_index, averaged)
            result = await loop.run_in_executor(None, self.codec.decode, encoded, raw_part.numel())
            self.tensor_part_container.register_processed_part(peer_index, part_index, result)

    async def _receive_from_reducer(self, peer_id: PeerID, peer_index: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            async for msg in aiter_with_timeout(stream, self.reducer_timeout):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                numel = self._expected_numel(peer_index, part_index)
                self.bytes_received += len(msg.tensor_part.buffer)
                part = await loop.run_in_executor(None, self.codec.decode, msg.tensor_part, numel)
                self.tensor_part_container.register_processed_part(peer_index, part_index, part)
                part_index += 1
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]
            if part_index != expected:
                raise AllreduceException(f"{peer_id} sent {part_index} averaged parts, expected {expected}")
        except BaseException as exc:
            self.failed_reducers.add(peer_id)
            if isinstance(exc, Exception):
                logger.warning("averaged part from reducer %s refused or missing: %s", peer_id, exc)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(message.tensor_part.buffer)
            yield message

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        loop = asyncio.get_running_loop()
        my_index = self.ordered_peer_ids.index(self.peer_id)
        sender = self.sender_peer_ids[sender_index]
        part_index = 0
        try:
            async for msg in stream:
                try:
                    numel = self._expected_numel(my_index, part_index)
                    self.bytes_received += len(msg.tensor_part.buffer)
                    part = await loop.run_in_executor(None, self.codec.decode, msg.tensor_part, numel)
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
                    break
                encoded = await self._encode_once(part_index, averaged)
                part_index += 1
                self.bytes_sent += len(encoded.buffer)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(sender)


class RoundFailedError(AllreduceException):
    """This peer did not receive every averaged part; its vector was left untouched."""


def stale_members(group_info: GroupInfo, serializer: Any) -> frozenset[PeerID]:
    """Members that did not start the round from the group's agreed state (``protocol.
    agreement``: the strict-majority digest of the newest round a member stated). Every member
    computes the same set from the same gathered bytes. Raises ``RoundFailedError`` when the
    members stated states but agree on none (a tie, e.g. two members of one round with two
    digests): nobody can tell whose pseudo-gradient is the swarm's, so the group averages
    nothing and every member re-checks. Nobody stated a state: nobody is stale."""
    members: list[tuple[str, object]] = []
    for peer, raw in zip(group_info.peer_ids, group_info.gathered):
        try:
            _bandwidth, _mode, user_bytes = serializer.loads(raw)
            data = serializer.loads(user_bytes)
        except Exception:  # noqa: BLE001 - unreadable gather: no vote
            data = None
        members.append((str(peer), data))
    votes = gathered_votes(members)
    if not votes:
        return frozenset()
    agreed = agreed_state(votes)
    if agreed is None:
        raise RoundFailedError(
            "the group's members started from different states and no strict majority agrees on one; not averaging"
        )
    in_sync = {vote.voter for vote in votes if (vote.round, vote.digest) == (agreed.round, agreed.digest)}
    return frozenset(peer for peer in group_info.peer_ids if str(peer) not in in_sync)


def _check_weight(weight: float) -> float:
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise MalformedTensorError(f"averaging weight must be finite and in (0, {MAX_WEIGHT:g}], got {weight!r}")
    return float(weight)


STATE_OVERHEAD_BYTES = 1 << 16
"""Slack over the raw tensor bytes a served state may take (serialization headers)."""

StateProvider = Callable[[], tuple[int, torch.Tensor, torch.Tensor, str]]


class ExactAverager(DecentralizedAverager):
    """A DecentralizedAverager over one flat float32 vector with bit-identical results.

    After a successful ``step`` the vector (``get_tensors()[0]``) holds the weighted
    average of the group's decoded contributions, identical in every member.
    """

    runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner

    def __init__(
        self, numel: int, dht: Any, *, codec: Codec, prefix: str, gate: MemberGate | None = None, **kwargs: Any
    ) -> None:
        self.codec_compression = CodecCompression(codec)
        self.numel = numel
        self.gate = gate
        """When set, only the peers it admits may join our groups, lead them or download state."""
        self._stats: dict[bytes, dict[str, Any]] = {}
        self.state_provider: StateProvider | None = None
        """Set in the host process: returns the (round, params, momentum, digest) to serve."""
        super().__init__(
            [torch.zeros(numel, dtype=torch.float32)],
            dht,
            prefix=prefix,
            compression=self.codec_compression,
            part_size_bytes=PART_SIZE_BYTES,
            **kwargs,
        )

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        started = time.monotonic()
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.pop("compression", None)
        kwargs.pop("part_size_bytes", None)
        stale = stale_members(group_info, self.serializer)
        if stale:
            logger.warning(
                "round with %s: they started from another state than the group; their parts count 0",
                sorted(map(str, stale)),
            )
        runner = self.runner_class(
            codec=self.codec_compression,
            stale=stale,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, "group must be registered before all-reduce"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        results = [result async for result in runner]
        if runner.failed_reducers or runner.tensor_part_container.failed_size:
            raise RoundFailedError(f"missing averaged parts from {sorted(map(str, runner.failed_reducers))}")
        for tensor, result in zip(tensors, results):
            tensor.copy_(result)
        self._stats[group_id] = {
            "bytes_sent": runner.bytes_sent,
            "bytes_received": runner.bytes_received,
            "refused_senders": {str(k): v for k, v in runner.refused_senders.items()},
            "allreduce_s": time.monotonic() - started,
            "peer_ids": [str(p) for p in group_info.peer_ids],
        }

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        """Returns ``{"gathered": {peer_id: data}, "stats": {...}}`` to ``step()``'s caller."""
        outsiders = [peer for peer in group_info.peer_ids if not await self._admitted(peer)]
        if outsiders:
            raise RoundFailedError(f"group includes peers not admitted to this run: {sorted(map(str, outsiders))}")
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        stats = self._stats.pop(group_info.group_id, {})
        return {"gathered": {str(k): v for k, v in gathered.items()}, "stats": stats}

    # --- authorized averaging (protocol.membership) -------------------------------------------

    async def _admitted(self, peer: PeerID) -> bool:
        if self.gate is None or peer == self.peer_id:
            return True
        gate = self.gate

        async def fetch() -> Lookup:
            members = await self.dht.get(gate.key, latest=True, return_future=True)
            revocations = await self.dht.get(gate.revocations_key, latest=True, return_future=True)
            return Lookup(
                members.value if members is not None and isinstance(members.value, dict) else None,
                revocations.value if revocations is not None and isinstance(revocations.value, dict) else None,
            )

        return await gate.admitted(str(peer), fetch)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads typing's hint
        if not await self._admitted(context.remote_id):
            logger.warning("refused a join request from %s: not admitted to this run", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admitted(context.remote_id):
            logger.warning("refused a state download by %s: not admitted to this run", context.remote_id)
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": "not admitted to this run"}))
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    @property
    def _matchmaking(self) -> Any:
        try:
            return self.__dict__["_gated_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Any) -> None:
        """hivemind creates its Matchmaking inside the averager process: wrap its requests to
        leaders so this peer never asks a leader that is not admitted (it would fail the round)."""
        if self.gate is not None:
            request_join = matchmaking._request_join_group

            async def request_admitted_leader(leader: PeerID) -> Any:
                if not await self._admitted(leader):
                    logger.info("not joining %s's group: it is not admitted to this run", leader)
                    return None
                return await request_join(leader)

            matchmaking._request_join_group = request_admitted_leader
        self.__dict__["_gated_matchmaking"] = matchmaking

    def set_allreduce_timeout(self, timeout_s: float) -> None:
        """Change the all-reduce deadline (and per-chunk sender/reducer timeouts) from now on."""
        self._outer_pipe.send(("_set_allreduce_timeout", [], dict(timeout_s=float(timeout_s))))

    async def _set_allreduce_timeout(self, timeout_s: float) -> None:
        self._allreduce_timeout = timeout_s
        self.allreduce_kwargs["sender_timeout"] = timeout_s / 3
        self.allreduce_kwargs["reducer_timeout"] = 2 * timeout_s / 3

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        """Runs in the host process when a peer downloads our state: (metadata, tensors, infos)."""
        if self.state_provider is None:
            return {}, [], None
        round_, params, momentum, digest = self.state_provider()
        return {"round": round_, "digest": digest}, [params, momentum], None

    def load_verified_state(
        self, accept: set[str] | None, timeout: float
    ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """Download (round, params, momentum) from the first peer whose state digest is in
        ``accept``; peers serving anything else are refused with a logged reason. None if none did.
        ``accept=None`` takes any state whose bytes match the digest its server claims (the
        caller verifies that digest itself, later)."""
        future: MPFuture = MPFuture()
        wanted = None if accept is None else sorted(accept)
        self._outer_pipe.send(("_load_verified_state", [], dict(accept=wanted, timeout=timeout, future=future)))
        return future.result(timeout=timeout * 4 + 10)

    async def _load_verified_state(self, accept: list[str] | None, timeout: float, future: MPFuture) -> None:
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await self.dht.get(key, latest=True, return_future=True)
            candidates = list(found.value.keys()) if found is not None and isinstance(found.value, dict) else []
            random.shuffle(candidates)
            for raw_peer in candidates:
                try:
                    peer = PeerID(raw_peer)
                except Exception:  # noqa: BLE001 - a malformed DHT subkey
                    continue
                if peer == self.peer_id:
                    continue
                if not await self._admitted(peer):
                    logger.info("not downloading state from %s: it is not admitted to this run", peer)
                    continue
                try:
                    wanted = None if accept is None else set(accept)
                    state = await asyncio.wait_for(self._download_state_from(peer, wanted), timeout)
                except Exception as exc:  # noqa: BLE001 - any failure of one peer: try the next
                    logger.warning("refused state from %s: %s", peer, str(exc) or type(exc).__name__)
                    continue
                future.set_result(state)
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state_from(
        self, peer: PeerID, accept: set[str] | None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[runtime_pb2.Tensor] = []
        limit, received = 2 * self.numel * 4 + STATE_OVERHEAD_BYTES, 0
        async for message in stream:
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
                if isinstance(metadata, dict) and isinstance(metadata.get("error"), str):
                    raise MalformedTensorError(f"it refused: {metadata['error'][:200]}")
                # the claim comes first: refuse a state we would not accept before its tensors
                claimed = metadata.get("digest") if isinstance(metadata, dict) else None
                if not isinstance(claimed, str) or (accept is not None and claimed not in accept):
                    raise MalformedTensorError(f"serves state {str(claimed)[:19]}..., not the one asked for")
            received += len(message.tensor_part.buffer)
            if received > limit:
                raise MalformedTensorError(f"state larger than {limit} bytes")
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not isinstance(metadata, dict) or not isinstance(metadata.get("round"), int):
            raise MalformedTensorError("no state metadata")
        if len(tensors) != 2 or any(t.dtype != torch.float32 or t.shape != (self.numel,) for t in tensors):
            raise MalformedTensorError(f"state is not two float32 vectors of {self.numel} values")
        params, momentum = tensors
        digest = state_digest(metadata["round"], params, momentum)
        if digest not in (accept if accept is not None else {metadata.get("digest")}):
            raise MalformedTensorError(f"state digest {digest[:19]}... of round {metadata['round']} is not the swarm's")
        return metadata["round"], params, momentum
