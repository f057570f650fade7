"""``StateTransferMixin._download_state_from`` against a server that, like ours
(``engine.stream_close``), ends its stream only once the downloader has closed it: the
downloader closes as soon as it holds both vectors, and verifies what it got."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from hivemind.compression import NoCompression
from hivemind.compression.base import CompressionInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from engine.state_transfer import StateTransferMixin
from engine.state_wanted import Wanted
from protocol.errors import MalformedTensorError
from protocol.statesync import state_digest

NUMEL = 40_000  # 160 KB a vector: several 64 KiB chunks each


class _HeldServer:
    """Serves (round, params, momentum) as hivemind's ``rpc_download_state`` does whatever the
    request asks for (as a server that ignores it would), then waits until its reader closes
    the stream (or a minute)."""

    def __init__(self, round_: int, params: torch.Tensor, momentum: torch.Tensor, digest: str) -> None:
        self.round, self.tensors, self.digest = round_, [params, momentum], digest
        self.closed_by_reader = False
        self.requests: list[bytes] = []

    async def rpc_download_wanted_state(self, request: averaging_pb2.AveragingData) -> AsyncIterator[Any]:
        self.requests.append(bytes(request.peer_id))
        return self._stream()

    async def _stream(self) -> AsyncIterator[averaging_pb2.DownloadData]:
        metadata: bytes | None = MSGPackSerializer.dumps({"round": self.round, "digest": self.digest})
        try:
            for i, tensor in enumerate(self.tensors):
                serialized = NoCompression().compress(tensor, CompressionInfo.from_tensor(tensor, key=i))
                for part in split_for_streaming(serialized):
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                    metadata = None
            await asyncio.sleep(60)
        except GeneratorExit:
            self.closed_by_reader = True
            raise


class _Downloader(StateTransferMixin):
    def __init__(self, server: _HeldServer) -> None:
        self.numel, self.prefix, self.serializer, self._p2p = NUMEL, "test", MSGPackSerializer, None
        self.server = server

    def get_stub(self, p2p: Any, peer: Any, *, namespace: str | None = None) -> Any:
        return self.server


def _state(round_: int = 7) -> tuple[int, torch.Tensor, torch.Tensor, str]:
    params = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    return round_, params, momentum, state_digest(round_, params, momentum)


def test_the_downloader_closes_the_stream_once_it_holds_the_state_and_verifies_it() -> None:
    round_, params, momentum, digest = _state()
    server = _HeldServer(round_, params, momentum, digest)

    async def download() -> tuple[int, torch.Tensor, torch.Tensor]:
        return await asyncio.wait_for(_Downloader(server)._download_state_from(None, {digest}, 10.0), 10)  # type: ignore[arg-type]

    got_round, got_params, got_momentum = asyncio.run(download())
    assert got_round == round_
    assert torch.equal(got_params, params) and torch.equal(got_momentum, momentum)
    assert server.closed_by_reader


def test_a_state_other_than_the_one_asked_for_is_refused_and_the_stream_closed() -> None:
    round_, params, momentum, digest = _state()
    server = _HeldServer(round_, params, momentum, digest)

    async def download() -> Any:
        return await asyncio.wait_for(_Downloader(server)._download_state_from(None, {"blake3:other"}, 10.0), 10)  # type: ignore[arg-type]

    with pytest.raises(MalformedTensorError, match="not the one asked for"):
        asyncio.run(download())
    assert server.closed_by_reader
    # the request said what it takes: a server of ours answers another state with its metadata alone
    assert Wanted.parse(MSGPackSerializer, server.requests[0]) == Wanted(frozenset({"blake3:other"}))


class _MetadataFlood(_HeldServer):
    """Sends its metadata with every part, each padded to ``pad`` bytes: what the state's cap
    did not count before (a peer could send any amount that way)."""

    def __init__(self, *args: Any, pad: int) -> None:
        super().__init__(*args)
        self.pad = pad

    async def _stream(self) -> AsyncIterator[averaging_pb2.DownloadData]:
        metadata = MSGPackSerializer.dumps({"round": self.round, "digest": self.digest, "pad": "x" * self.pad})
        for i, tensor in enumerate(self.tensors):
            serialized = NoCompression().compress(tensor, CompressionInfo.from_tensor(tensor, key=i))
            for part in split_for_streaming(serialized):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)


@pytest.mark.parametrize("pad", [10, 100_000], ids=["repeated", "large"])
def test_metadata_sent_again_or_too_large_is_refused(pad: int) -> None:
    round_, params, momentum, digest = _state()
    server = _MetadataFlood(round_, params, momentum, digest, pad=pad)

    async def download() -> tuple[int, torch.Tensor, torch.Tensor]:
        return await asyncio.wait_for(_Downloader(server)._download_state_from(None, {digest}, 10.0), 10)  # type: ignore[arg-type]

    with pytest.raises(MalformedTensorError, match="metadata sent twice or larger than"):
        asyncio.run(download())


class _EarlierServer(_HeldServer):
    """A member of an earlier version: p2pd refuses the handler it does not serve at once, and
    it serves hivemind's download alone."""

    async def rpc_download_wanted_state(self, request: averaging_pb2.AveragingData) -> AsyncIterator[Any]:
        raise ControlFailure("Connect failed. msg=failed to negotiate protocol: protocols not supported: [x]")

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest) -> AsyncIterator[Any]:
        return self._stream()


def test_a_member_of_an_earlier_version_still_serves_its_state_through_hiveminds_download() -> None:
    round_, params, momentum, digest = _state()
    server = _EarlierServer(round_, params, momentum, digest)

    async def download() -> tuple[int, torch.Tensor, torch.Tensor]:
        return await asyncio.wait_for(_Downloader(server)._download_state_from(None, {digest}, 10.0), 10)  # type: ignore[arg-type]

    got_round, got_params, _ = asyncio.run(download())
    assert got_round == round_ and torch.equal(got_params, params)


class _Refusing(_HeldServer):
    async def rpc_download_wanted_state(self, request: averaging_pb2.AveragingData) -> AsyncIterator[Any]:
        raise ControlFailure("Connect failed. msg=dial backoff")


def test_any_other_refusal_to_open_is_that_servers_failure() -> None:
    round_, params, momentum, digest = _state()

    async def download() -> Any:
        return await asyncio.wait_for(
            _Downloader(_Refusing(round_, params, momentum, digest))._download_state_from(None, {digest}, 10.0), 10
        )  # type: ignore[arg-type]

    with pytest.raises(ControlFailure, match="dial backoff"):
        asyncio.run(download())
