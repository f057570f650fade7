"""A state download that names what it takes costs nothing when the server holds something else:
the server answers with its state's metadata alone and opens no file (``engine.state_wanted``).

Before, every download streamed the state right behind its metadata and the downloader refused
it on reading the metadata; on a home link the refused state's bytes already on their way (up to
a whole state per server asked) held up the next server's answer past the download's timeout,
one server after another (``tests/integration/test_slow_joiner.py`` failed that way about one
run in four). Real averager processes on loopback; the requests are sent as a stranger to the
code would send them, from another member's own libp2p node."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.state_wanted import Wanted
from peer.swarm.swarm import Swarm
from protocol.spec import parse_spec
from protocol.statesync import state_digest
from tests.specs import tiny_spec

SPEC = tiny_spec("wanted", context=16, inner_steps=2)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NUMEL = 400_000
"""1.6 MB a vector: tens of 64 KiB parts."""
QUIET_S = 2.0
"""How long a server that sent its metadata must stay silent for the state to count as refused."""


async def read_all(
    server: str, prefix: str, requests: list[tuple[str, bytes | None]], _dht: Any, node: Any
) -> list[Any]:
    """In the asker's DHT process: for each (rpc, request) read the whole stream (10 s at most)
    and return (metadata messages, their decoded contents, tensor bytes) per request."""
    stub = ExactAverager.get_stub(node.p2p, PeerID.from_base58(server), namespace=prefix)
    results = []
    for rpc, raw in requests:
        if rpc == "rpc_download_state":
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        else:
            stream = await getattr(stub, rpc)(averaging_pb2.AveragingData(peer_id=raw or b""))
        told: list[Any] = []
        tensor_bytes = 0
        try:
            # our servers keep a stream open until its reader closes it (``engine.stream_close``):
            # read until the whole state is here, or until the server has been silent for
            # QUIET_S after its metadata (on loopback a state's parts follow it within milliseconds)
            messages = aiter(stream)
            while tensor_bytes < 2 * NUMEL * 4:
                try:
                    message = await asyncio.wait_for(anext(messages), QUIET_S if told else 10)
                except (StopAsyncIteration, TimeoutError):
                    break
                if message.metadata:
                    told.append(MSGPackSerializer.loads(message.metadata))
                tensor_bytes += len(message.tensor_part.buffer)
        finally:
            await stream.aclose()
        results.append((told, tensor_bytes))
    return results


def test_a_refused_state_costs_no_tensor_bytes_and_a_wanted_one_comes_whole() -> None:
    spec = parse_spec(SPEC)
    codec = get_codec("none")
    params, momentum = torch.randn(NUMEL), torch.randn(NUMEL)
    digest = state_digest(7, params, momentum)
    lock = threading.Lock()
    server = Swarm(spec, NUMEL, codec, initial_peers=[], host_maddrs=LOOPBACK)
    asker = None
    try:

        def provide(take: Any) -> dict[str, Any]:
            with lock:
                return take(7, params, momentum, digest)

        server.serve_state(provide)
        server.averager.allow_state_sharing = True
        asker = Swarm(spec, NUMEL, codec, initial_peers=server.visible_maddrs, host_maddrs=LOOPBACK)
        other = Wanted(frozenset({"blake3:" + "0" * 64})).dumps(MSGPackSerializer)
        older = Wanted(frozenset({"blake3:" + "0" * 64}), newer_than=7).dumps(MSGPackSerializer)
        newer = Wanted(frozenset({"blake3:" + "0" * 64}), newer_than=6).dumps(MSGPackSerializer)
        requests = [
            ("rpc_download_wanted_state", other),
            ("rpc_download_wanted_state", older),
            ("rpc_download_wanted_state", newer),
            ("rpc_download_wanted_state", Wanted(frozenset({digest})).dumps(MSGPackSerializer)),
            ("rpc_download_wanted_state", b"\xc1 not msgpack"),
            ("rpc_download_wanted_state", MSGPackSerializer.dumps([["x"] * 1000, None])),
            ("rpc_download_wanted_state", None),
            ("rpc_download_state", None),  # hivemind's, which says nothing of what it takes
        ]
        ask = functools.partial(read_all, server.averager.peer_id.to_base58(), server.averager.prefix, requests)
        got = asker.dht.run_coroutine(ask, return_future=True).result(timeout=120)
        whole = 2 * NUMEL * 4
        (told_other, bytes_other), (told_older, bytes_older), (_, bytes_newer), (_, bytes_named) = got[:4]
        assert told_other == [{"round": 7, "digest": digest}] and bytes_other == 0
        assert told_older == [{"round": 7, "digest": digest}] and bytes_older == 0
        assert bytes_newer == whole and bytes_named == whole
        for told, tensor_bytes in got[4:7]:  # garbage, a request over the cap, an empty one
            assert told == [{"error": "malformed request"}] and tensor_bytes == 0
        assert got[7][1] == whole  # the old RPC still streams whatever it has
        # and the swarm's own download takes it, digest checked, or refuses it at no cost
        taken = asker.download_state({digest}, timeout=30)
        assert taken is not None and taken[0] == 7 and torch.equal(taken[1], params) and torch.equal(taken[2], momentum)
        assert asker.download_state({"blake3:" + "1" * 64}, timeout=30) is None
    finally:
        for swarm in (asker, server):
            if swarm is not None:
                swarm.shutdown()
