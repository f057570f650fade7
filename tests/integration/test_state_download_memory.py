"""A member that opens many state downloads at once and leaves them open costs the server no
memory per download: the state is written once to a file and streamed from it
(``engine.state_snapshot``). Before, every download cloned θ_g and the momentum in the host,
moved the clone through shared memory to the averager and serialized it there whole, all held
while the stream stayed open: an admitted member that opened downloads and never read them
grew a peer's memory by two states per stream, as far as it liked."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from engine.averager import ExactAverager
from engine.codecs import get_codec
from peer.swarm.swarm import Swarm
from protocol.spec import parse_spec
from protocol.statesync import state_digest
from tests.specs import tiny_spec

SPEC = tiny_spec("served", context=16, inner_steps=2)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NUMEL = 8_000_000
"""32 MB a vector, 64 MB a state."""
STREAMS = 6
HOLD_S = 6.0


async def hold_downloads(server: str, prefix: str, streams: int, hold_s: float, _dht: Any, node: Any) -> list[int]:
    """In the attacker's DHT process: open ``streams`` state downloads from ``server``, read each
    one's metadata and first part, keep them all open ``hold_s`` without reading, then close."""
    stub = ExactAverager.get_stub(node.p2p, PeerID.from_base58(server), namespace=prefix)
    opened, firsts = [], []
    try:
        for _ in range(streams):
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            opened.append(stream)
            first = await anext(stream)  # the metadata alone
            part = await anext(stream)
            firsts.append(len(first.metadata) + len(part.tensor_part.buffer))
        await asyncio.sleep(hold_s)
    finally:
        for stream in opened:
            await stream.aclose()
    return firsts


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss for {pid}")


def test_held_open_downloads_cost_the_server_no_memory_per_download() -> None:
    spec = parse_spec(SPEC)
    codec = get_codec("none")
    params, momentum = torch.randn(NUMEL), torch.randn(NUMEL)
    digest = state_digest(7, params, momentum)
    lock = threading.Lock()
    server = Swarm(spec, NUMEL, codec, initial_peers=[], host_maddrs=LOOPBACK)
    attacker = None
    served: Path | None = None
    try:

        def provide(take: Any) -> dict[str, Any]:
            with lock:
                return take(7, params, momentum, digest)

        server.serve_state(provide)
        server.averager.allow_state_sharing = True
        attacker = Swarm(spec, NUMEL, codec, initial_peers=server.visible_maddrs, host_maddrs=LOOPBACK)
        server_pid = server.averager.pid
        assert server_pid is not None
        before = pss(server_pid)
        hold = functools.partial(
            hold_downloads, server.averager.peer_id.to_base58(), server.averager.prefix, STREAMS, HOLD_S
        )
        future = attacker.dht.run_coroutine(hold, return_future=True)
        peak, deadline = before, time.monotonic() + 120
        while not future.done():
            assert time.monotonic() < deadline, "the held downloads did not end"
            peak = max(peak, pss(server_pid))
            time.sleep(0.1)  # a sampling interval, not a wait for anything
        firsts = future.result()
        served = server.averager.served_state_file()
        assert served is not None and served.exists()
        assert len(firsts) == STREAMS and all(n > 0 for n in firsts)
        grown = peak - before
        # less than one state (64 MB) for them all; before, each held stream kept more than one
        assert grown < 2 * NUMEL * 4, f"the averager grew {grown / 1e6:.0f} MB serving {STREAMS} held downloads"
        # and a whole download still gives the state, digest checked
        got = attacker.download_state({digest}, timeout=30)
        assert got is not None and got[0] == 7 and torch.equal(got[1], params) and torch.equal(got[2], momentum)
    finally:
        for swarm in (attacker, server):
            if swarm is not None:
                swarm.shutdown()
    assert not served.exists(), "the served state's file outlived the averager"
