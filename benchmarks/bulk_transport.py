"""What the bulk channel's transport alone costs per byte: its TLS connection and frames
(``engine.bulk_reader``, ``engine.bulk_frames``) carrying frames of a part's size from one end to
the other, both ends in one process and one thread, with nothing done with the bytes. Its Gbit per
CPU second (send and receive of each byte) bounds what an averager, which both sends and receives
every byte it counts as sent, can reach per CPU second however fast its averaging gets.

    python -m benchmarks.bulk_transport --megabytes 400 --frame-kib 640 --trials 3

``benchmarks.loopback_averaging`` runs it beside the all-reduce (its "transport alone" line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time

__all__ = ["transport_gbit_per_cpu_s"]


async def _one_trial(megabytes: int, frame_bytes: int) -> dict[str, float]:
    from engine.bulk_frames import Kind, write_frame
    from engine.bulk_reader import FrameProtocol, open_frames
    from engine.bulk_tls import client_context, make_server_cert

    loop = asyncio.get_running_loop()
    cert = make_server_cert()
    frames = max(1, megabytes * 10**6 // frame_bytes)
    payload = os.urandom(frame_bytes)
    received = loop.create_future()

    async def drain(reader: object) -> None:
        got = 0
        for _ in range(frames):
            got += len((await reader.read())[2])  # type: ignore[attr-defined]
        received.set_result(got)

    def accepted() -> FrameProtocol:
        protocol = FrameProtocol()
        asyncio.ensure_future(drain(protocol.reader))
        return protocol

    server = await loop.create_server(accepted, "127.0.0.1", 0, ssl=cert.context)
    port = server.sockets[0].getsockname()[1]
    _reader, writer = await open_frames("127.0.0.1", port, ssl=client_context(), server_hostname="")
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(frames):
        write_frame(writer, Kind.DATA, payload, 1)
        await writer.drain()
    got = await received
    after = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - wall
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    writer.close()
    server.close()
    return {"bytes": float(got), "cpu_s": cpu, "wall_s": wall, "gbit_per_cpu_s": got * 8 / cpu / 1e9}


def transport_gbit_per_cpu_s(megabytes: int = 400, frame_bytes: int = 640 * 1024, trials: int = 3) -> dict[str, float]:
    """The median of ``trials`` runs: Gbit per CPU second of the bare transport (send and
    receive of each byte), on this process's event loop policy's loop (uvloop where installed,
    as in an averager)."""
    try:
        import uvloop  # hivemind's averagers run on it

        run = uvloop.run
    except ImportError:  # pragma: no cover - hivemind depends on it
        run = asyncio.run
    rows = [run(_one_trial(megabytes, frame_bytes)) for _ in range(trials)]
    return {
        "gbit_per_cpu_s": statistics.median(r["gbit_per_cpu_s"] for r in rows),
        "spread": [round(r["gbit_per_cpu_s"], 2) for r in rows],  # type: ignore[dict-item]
        "frame_bytes": float(frame_bytes),
        "megabytes": float(megabytes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--frame-kib", type=int, default=640)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(transport_gbit_per_cpu_s(args.megabytes, args.frame_kib * 1024, args.trials)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
