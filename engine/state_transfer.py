"""State download and serving between members of a run, verified by digest: a newcomer or a
peer that fell out of sync downloads (round, θ_g, outer momentum) from an admitted member that
serves the state the swarm agrees on. Mixed into ``engine.averager.ExactAverager``; the
host process sets ``state_provider`` to what it serves."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from engine.state_snapshot import StateSnapshots, chunks
from engine.state_wanted import Wanted
from protocol.errors import MalformedTensorError
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

STATE_OVERHEAD_BYTES = 1 << 16
"""Slack over the raw tensor bytes a served state may take (serialization headers, metadata)."""
SLOWEST_LINK_BYTES_S = 125_000
"""The slowest download a host waits for (1 Mbit/s): a state download has no deadline of its own,
only a server that stays silent for ``timeout`` fails (a slow link takes as long as it takes),
so the host's wait is bounded by the state's size at this rate instead."""
UNSUPPORTED = ("protocol not supported", "protocols not supported")
"""What the remote's libp2p daemon says, at once, for a handler it does not serve (a member of an
earlier version; ``engine.liveness`` reads it the same way)."""
MAX_METADATA_BYTES = 4096
"""A served state's metadata (its round and digest: tens of bytes), sent once; more is refused
before it is parsed."""

StateTaker = Callable[[int, torch.Tensor, torch.Tensor, str], dict[str, Any]]
StateProvider = Callable[[StateTaker], dict[str, Any]]
"""Set in the host process: calls its argument with (round, params, momentum, digest) (the
tensors are read then, not kept) and returns what that returned
(``engine.state_snapshot.StateSnapshots.write``); raises if the state changed meanwhile (what was
read may be torn: nothing is served)."""


class StateTransferMixin:
    """``load_verified_state`` (host process) and the averager-process side of it."""

    state_provider: StateProvider | None
    """Set in the host process: the state to serve (``StateProvider``)."""
    allow_state_sharing: bool
    update_store: Any
    numel: int
    prefix: str
    dht: Any
    peer_id: PeerID
    serializer: Any
    _outer_pipe: Any
    _p2p: Any
    _matchmaking: Any

    if TYPE_CHECKING:  # provided by the gate mixin and by hivemind's ServicerBase

        async def _admitted(self, peer: PeerID, *, stale_ok: bool = False) -> bool: ...

        def get_stub(self, p2p: Any, peer: PeerID, *, namespace: str | None = None) -> Any: ...

        async def _get_current_state_from_host_process(self) -> tuple[bytes, Sequence[torch.Tensor], Any]: ...

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        """Runs in the host process when a peer downloads our state: (metadata, no tensors, no
        infos), the metadata naming the state's file (``engine.state_snapshot``), which the
        averager process streams (``_serve_state``)."""
        if self.state_provider is None:
            return {}, [], None
        snapshots = self.__dict__.get("_snapshots")
        if snapshots is None:
            store = getattr(self, "update_store", None)
            snapshots = self.__dict__["_snapshots"] = StateSnapshots(store.directory if store is not None else None)
        return self.state_provider(snapshots.write), [], None

    def served_state_file(self) -> Path | None:
        """The served state's file (host process): None before anyone downloaded it."""
        snapshots = self.__dict__.get("_snapshots")
        return snapshots.path if snapshots is not None else None

    def shutdown(self) -> None:
        """hivemind's, then the served state's file goes (host process)."""
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            snapshots = self.__dict__.get("_snapshots")
            if snapshots is not None:
                snapshots.close()

    async def _serve_state(self, wanted: Wanted | None = None) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The state download's stream (averager process): the metadata alone, then both vectors
        read from the state's file a chunk at a time; the metadata alone if the state is not one
        ``wanted`` (``engine.state_wanted``). Nothing while this peer serves no state."""
        if not self.allow_state_sharing:
            return
        loop = asyncio.get_running_loop()
        source, metadata = None, None
        for _ in range(2):  # once more if a newer round's file replaced it before it was opened
            raw, _tensors, _infos = await self._get_current_state_from_host_process()
            metadata = self.serializer.loads(raw)
            if not isinstance(metadata, dict) or "snapshot" not in metadata:
                return
            if wanted is not None and not wanted.takes(metadata.get("round"), metadata.get("digest")):
                told = {"round": metadata.get("round"), "digest": metadata.get("digest")}
                yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(told))
                return
            try:
                source = await loop.run_in_executor(None, open, metadata.pop("snapshot"), "rb")
                break
            except FileNotFoundError:
                continue
        if source is None or metadata is None:
            raise OSError("the served state's file was replaced twice before it could be read")
        with source:
            numel = int(metadata.pop("numel"))
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(metadata))
            parts = chunks(source, numel)
            while (part := await loop.run_in_executor(None, next, parts, None)) is not None:
                yield averaging_pb2.DownloadData(tensor_part=part)

    def load_verified_state(
        self, accept: set[str] | None, timeout: float, newer_than: int | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """Download (round, params, momentum) from the first peer whose state digest is in
        ``accept``, or whose state is of a round after ``newer_than`` (the swarm moved on since
        the caller read its records: the caller verifies that state's digest against the
        records, later); peers serving anything else are refused with a logged reason, before
        any tensor is read. None if none did. Whatever is taken matches the digest its server
        claims. ``accept=None`` takes any state (the caller verifies it). ``timeout``: the
        longest a server may stay silent, not the download's length."""
        future: MPFuture = MPFuture()
        wanted = None if accept is None else sorted(accept)
        self._outer_pipe.send(
            (
                "_load_verified_state",
                [],
                dict(accept=wanted, timeout=timeout, future=future, newer_than=newer_than),
            )
        )
        return future.result(timeout=timeout * 4 + 10 + 8 * self.numel / SLOWEST_LINK_BYTES_S)

    async def _load_verified_state(
        self, accept: list[str] | None, timeout: float, future: MPFuture, newer_than: int | None = None
    ) -> None:
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await self.dht.get(key, latest=True, return_future=True)
            candidates = list(found.value.keys()) if found is not None and isinstance(found.value, dict) else []
            self.__dict__["_update_listing"] = (list(candidates), time.monotonic())  # whom to ask for updates next
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
                    state = await self._download_state_from(peer, wanted, timeout, newer_than)
                except Exception as exc:  # noqa: BLE001 - any failure of one peer: try the next
                    logger.warning("refused state from %s: %s", peer, str(exc) or type(exc).__name__)
                    continue
                # it is up, it is admitted and its link is warm: the rounds' updates the newcomer
                # rolls forward by are asked of it first (``UpdateTransferMixin._update_servers``)
                self.__dict__["_update_server"] = peer
                future.set_result(state)
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state_from(
        self, peer: PeerID, accept: set[str] | None, timeout: float, newer_than: int | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        asked = Wanted(None if accept is None else frozenset(accept), newer_than)
        request = averaging_pb2.AveragingData(peer_id=asked.dumps(self.serializer))
        try:
            stream = await asyncio.wait_for(stub.rpc_download_wanted_state(request), timeout)
        except Exception as exc:
            if not any(text in str(exc) for text in UNSUPPORTED):
                raise
            # a member of an earlier version: hivemind's download, whose refusals cost tensor bytes
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
        metadata: Any = None
        told = False
        tensors: list[torch.Tensor] = []
        parts: list[runtime_pb2.Tensor] = []
        limit, received = 2 * self.numel * 4 + STATE_OVERHEAD_BYTES, 0
        whole, in_parts = self.numel * 4, 0  # bytes of one float32 vector as served (no compression)
        try:
            async for message in aiter_with_timeout(stream, timeout):
                received += len(message.metadata)  # counted against the cap too, before anything is parsed
                if received > limit:
                    raise MalformedTensorError(f"state larger than {limit} bytes")
                if message.metadata:
                    if told or len(message.metadata) > MAX_METADATA_BYTES:
                        raise MalformedTensorError(
                            f"state metadata sent twice or larger than {MAX_METADATA_BYTES} bytes"
                        )
                    told = True
                    metadata = self.serializer.loads(message.metadata)
                    if isinstance(metadata, dict) and isinstance(metadata.get("error"), str):
                        raise MalformedTensorError(f"it refused: {metadata['error'][:200]}")
                    # the claim comes first: refuse a state we would not accept before its tensors
                    claimed = metadata.get("digest") if isinstance(metadata, dict) else None
                    claimed_round = metadata.get("round") if isinstance(metadata, dict) else None
                    if not asked.takes(claimed_round, claimed):
                        raise MalformedTensorError(f"serves state {str(claimed)[:19]}..., not the one asked for")
                received += len(message.tensor_part.buffer)
                if received > limit:
                    raise MalformedTensorError(f"state larger than {limit} bytes")
                if not message.tensor_part.buffer and not message.tensor_part.dtype:
                    continue  # the metadata alone (our servers send it first: a refusal costs no tensor bytes)
                if message.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
                part_bytes = len(message.tensor_part.buffer)
                in_parts = part_bytes if message.tensor_part.dtype else in_parts + part_bytes
                if len(tensors) == 1 and in_parts >= whole:
                    break  # the whole state is here: close the stream (the server waits for that)
        finally:
            await stream.aclose()
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not isinstance(metadata, dict) or not isinstance(metadata.get("round"), int):
            raise MalformedTensorError("no state metadata")
        if len(tensors) != 2 or any(t.dtype != torch.float32 or t.shape != (self.numel,) for t in tensors):
            raise MalformedTensorError(f"state is not two float32 vectors of {self.numel} values")
        params, momentum = tensors
        digest = state_digest(metadata["round"], params, momentum)
        if digest != metadata.get("digest"):
            raise MalformedTensorError(f"state digest {digest[:19]}... of round {metadata['round']} is not the swarm's")
        return metadata["round"], params, momentum
