"""Averaging throughput on loopback against the part size, and the transport's own ceiling
(issue #12): ``python -m benchmarks.allreduce_parts``.

Two ``ExactAverager`` processes with their own DHT nodes (real hivemind, libp2p through p2pd,
one torch thread each) average a vector of ``--values`` values a few times per configuration;
throughput per peer is bytes sent × 8 ÷ all-reduce seconds, as ``make bench-scale`` reports it.
The ceiling is one libp2p stream between two p2pd daemons carrying 1 MiB messages one way
with nothing else running: what this machine's transport can move at all.

Writes ``benchmarks/results/allreduce_parts.{md,json}``; ``engine.allreduce.PART_SIZE_BYTES``
is chosen from it.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PART_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)


def measure_averaging(part_bytes: int, values: int, codec_name: str, rounds: int) -> list[dict[str, float]]:
    """Runs in a fresh process: two averagers on loopback, ``rounds`` all-reduces."""
    import torch
    from hivemind import DHT

    import engine.allreduce
    from engine.averager import ExactAverager
    from engine.codecs import get_codec

    engine.allreduce.part_size_bytes = lambda numel, codec, group_size: part_bytes  # type: ignore[assignment]
    torch.set_num_threads(1)
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in first.get_visible_maddrs()]
    )
    options: dict[str, Any] = dict(
        codec=get_codec(codec_name),
        prefix="bench",
        start=True,
        min_group_size=2,
        target_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=600.0,
    )
    averagers = [ExactAverager(values, dht, **options) for dht in (first, second)]
    try:
        for averager in averagers:
            with averager.get_tensors() as tensors:
                tensors[0].normal_()
        rows = []
        for _ in range(rounds):
            controls = [a.step(wait=False, gather={}, timeout=60) for a in averagers]
            outcomes = [c.result() for c in controls]
            for outcome in outcomes:
                stats = outcome.stats
                rows.append({"allreduce_s": stats.allreduce_s, "bytes_sent": stats.bytes_sent})
        return rows
    finally:
        for averager in averagers:
            averager.shutdown()
        first.shutdown()
        second.shutdown()


class _Sink(ServicerBase):
    """Counts what one stream carries."""

    # hivemind tells streaming handlers by ``typing.AsyncIterator`` annotations
    async def rpc_sink(
        self, stream: typing.AsyncIterator[runtime_pb2.Tensor], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.Tensor]:
        received = 0
        async for message in stream:
            received += len(message.buffer)
        yield runtime_pb2.Tensor(size=[received])


async def _stream_ceiling(total_mb: int) -> float:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
    try:
        await _Sink().add_p2p_handlers(server)
        stub = _Sink.get_stub(client, server.peer_id)
        payload = b"\x01" * (1 << 20)

        async def messages() -> AsyncIterator[runtime_pb2.Tensor]:
            for _ in range(total_mb):
                yield runtime_pb2.Tensor(buffer=payload)

        best = 0.0
        for _ in range(3):
            started = time.perf_counter()
            async for _reply in await stub.rpc_sink(messages()):
                pass
            best = max(best, total_mb * (1 << 20) * 8 / (time.perf_counter() - started) / 1e9)
        return best
    finally:
        await client.shutdown()
        await server.shutdown()


def _child(args: argparse.Namespace) -> int:
    if args.child == "ceiling":
        print(json.dumps({"gbit_s": asyncio.run(_stream_ceiling(200))}))
    else:
        print(json.dumps(measure_averaging(args.part, args.values, args.child, args.rounds)))
    return 0


def _run_child(*extra: str) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.allreduce_parts", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    results: list[dict[str, Any]] = []
    ceiling = _run_child("--child", "ceiling")["gbit_s"]
    plan = [("fp16", part) for part in PART_SIZES] + [("none", 1 << 20), ("int8", 1 << 20), ("4bit", 1 << 20)]
    for codec_name, part in plan:
        print(f"allreduce_parts: {codec_name}, {part >> 10} KiB parts", flush=True)
        rows = _run_child("--child", codec_name, "--part", str(part), "--values", str(args.values))
        rounds = rows[2:] or rows  # the first round warms up (connections, allocations)
        gbps = [r["bytes_sent"] * 8 / r["allreduce_s"] / 1e9 for r in rounds]
        results.append(
            {
                "codec": codec_name,
                "part_bytes": part,
                "values": args.values,
                "gbit_s_per_peer": statistics.median(gbps),
                "allreduce_s": statistics.median(r["allreduce_s"] for r in rounds),
                "mb_sent_per_peer": rounds[0]["bytes_sent"] / 1e6,
            }
        )
    header = (
        f"swarmtrain averaging throughput, {time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} CPUs), "
        f"2 averagers on loopback, {args.values / 1e6:.0f}M values; `python -m benchmarks.allreduce_parts`"
    )
    lines = [
        header,
        "",
        f"Transport ceiling (one libp2p stream through p2pd, one way, nothing else running): {ceiling:.2f} Gbit/s. "
        "An all-reduce of 2 peers moves 4 such streams at once on the same cores (each peer sends its "
        "share and the averaged parts back), so a peer can expect at most about half the ceiling.",
        "",
        "| codec | part | all-reduce s | MB sent/peer | Gbit/s per peer |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['codec']} | {r['part_bytes'] >> 10} KiB | {r['allreduce_s']:.2f} | {r['mb_sent_per_peer']:.0f} | "
            f"{r['gbit_s_per_peer']:.2f} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "allreduce_parts.md").write_text("\n".join(lines) + "\n")
    payload = {"header": header, "ceiling_gbit_s": ceiling, "results": results}
    (RESULTS / "allreduce_parts.json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
