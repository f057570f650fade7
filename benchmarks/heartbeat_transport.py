"""What one heartbeat costs a heartbeat process, over gRPC and as a UDP datagram (issue #52):
``python -m benchmarks.heartbeat_transport``.

    .venv/bin/python -m benchmarks.heartbeat_transport --rate 1500 --seconds 10 --trials 2

A real heartbeat process (``coordinator.front``, started by ``Fronts`` as the coordinator starts
it) whose table admits ``--keys`` peers; this process sends their heartbeats, signed ahead, at
``--rate`` per second for ``--seconds``, once over gRPC (16 channels, as
``benchmarks.coordinator_load``) and once as datagrams, alternating for ``--trials``. Per run:
the heartbeat process's CPU per answered beat (``/proc/PID/stat``), answers per second, latency
p50 / p99 seen by the sender, beats the process handed to the core. The ratio datagram / gRPC of
CPU per beat is the figure: at 10,000 peers beating every 5 s, 2,000 beats a second, it is the
share of a core the process needs. Writes ``heartbeat-transport-<label>.{md,json}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

CHANNELS = 16


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def signed_beats(keys: list[Any], count: int, start: float, rate: float) -> list[tuple[float, bytes, bytes]]:
    """(send offset, serialized HeartbeatRequest, its nonce) for ``count`` beats at ``rate``."""
    from protocol import coordinator_pb2 as pb
    from protocol import kinds
    from protocol.messages import sign_message

    beats = []
    for index in range(count):
        offset = index / rate
        body = pb.HeartbeatBody(round=index, phase=pb.PEER_PHASE_TRAINING, samples_per_second=5.0)
        signed = sign_message(keys[index % len(keys)], kinds.HEARTBEAT, body.SerializeToString(), now=start + offset)
        request = pb.HeartbeatRequest(signed=signed.to_proto())
        beats.append((offset, request.SerializeToString(), bytes(signed.nonce)))
    return beats


async def send_all(transport: str, port: int, beats: list[tuple[float, bytes, bytes]], begin: float) -> dict[str, Any]:
    """Send ``beats`` at their offsets from ``begin`` (monotonic); latencies and failures."""
    import grpc

    from benchmarks.coordinator_load import DatagramAnswers
    from protocol import coordinator_pb2 as pb
    from protocol.heartbeat_datagram import REQUEST_TAG

    latencies: list[float] = []
    failures = 0
    loop = asyncio.get_running_loop()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(CHANNELS)]
    calls = [
        c.unary_unary(
            "/swarmtrain.v1.Coordinator/Heartbeat",
            request_serializer=None,
            response_deserializer=pb.HeartbeatResponse.FromString,
        )
        for c in channels
    ]
    endpoints = [
        await loop.create_datagram_endpoint(DatagramAnswers, remote_addr=("127.0.0.1", port)) for _ in range(CHANNELS)
    ]

    async def one(index: int, raw: bytes, nonce: bytes) -> None:
        nonlocal failures
        sent = time.monotonic()
        if transport == "grpc":
            try:
                answer = await calls[index % CHANNELS](raw, timeout=30)
                if answer.admitted:
                    latencies.append(time.monotonic() - sent)
                    return
            except grpc.aio.AioRpcError:
                pass
            failures += 1
            return
        sock, protocol = endpoints[index % CHANNELS]
        future: asyncio.Future[None] = loop.create_future()
        protocol.waiting[nonce] = future
        sock.sendto(REQUEST_TAG + raw)
        try:
            await asyncio.wait_for(future, timeout=5)
            latencies.append(time.monotonic() - sent)
        except TimeoutError:
            protocol.waiting.pop(nonce, None)
            failures += 1

    tasks = []
    for index, (offset, raw, nonce) in enumerate(beats):
        delay = begin + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, raw, nonce)))
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    for sock, _ in endpoints:
        sock.close()
    return {"latencies": latencies, "failures": failures}


def one_run(transport: str, args: argparse.Namespace, keys: list[Any]) -> dict[str, Any]:
    from coordinator.front.link import Fronts
    from coordinator.front.process import FrontConfig
    from coordinator.front.wire import Answer, Beats

    applied = [0]
    table = {k.public_key.id: Answer(credit=(0, 0.0, 0)) for k in keys}

    def apply(batch: Beats) -> None:
        applied[0] += len(batch.beats)

    config = FrontConfig(
        host="127.0.0.1",
        port=0,
        reuse_port=False,
        max_requests_per_source=0.0,
        heartbeat_interval_s=5.0,
        max_age_s=300.0,
        max_future_s=30.0,
    )
    drained = [False]

    def drain() -> tuple[dict[str, Answer], tuple[str, ...]]:
        if drained[0]:
            return {}, ()
        drained[0] = True
        return table, ()

    fronts = Fronts(config, 1, apply=apply, drain=drain, everyone=lambda: table)
    port = fronts.start()
    try:
        fronts.sync(wait=True)
        (pid,) = fronts.pids()
        count = int(args.rate * args.seconds)
        start_wall = time.time() + 1.0 + count * 80e-6
        beats = signed_beats(keys, count, start_wall, args.rate)
        begin = time.monotonic() + (start_wall - time.time())
        begin = max(begin, time.monotonic() + 0.5)
        while time.monotonic() < begin - 0.05:  # the process's CPU from the first beat on
            time.sleep(0.01)
        cpu_before, window_before = cpu_seconds(pid), time.monotonic()
        sent = asyncio.run(send_all(transport, port, beats, begin))
        cpu = cpu_seconds(pid) - cpu_before
        window = time.monotonic() - window_before
        deadline = time.monotonic() + 10
        while applied[0] < len(sent["latencies"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        answered = len(sent["latencies"])
        return {
            "transport": transport,
            "sent": count,
            "answered": answered,
            "failures": sent["failures"],
            "handed_to_core": applied[0],
            "cpu_ms_per_beat": 1000 * cpu / max(1, answered),
            "cpu_share": cpu / window,
            "answers_per_s": answered / window,
            "p50_ms": 1000 * percentile(sent["latencies"], 0.5),
            "p99_ms": 1000 * percentile(sent["latencies"], 0.99),
        }
    finally:
        fronts.stop()


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| transport | trial | sent | answered | failed | handed to the core | process CPU ms per beat | "
        "share of a core | answers/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['transport']} | {r['trial']} | {r['sent']} | {r['answered']} | {r['failures']} | "
            f"{r['handed_to_core']} | {r['cpu_ms_per_beat']:.3f} | {r['cpu_share']:.2f} | {r['answers_per_s']:.0f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
        )
    by = {t: [r["cpu_ms_per_beat"] for r in results if r["transport"] == t] for t in ("grpc", "udp")}
    if by["grpc"] and by["udp"]:
        ratio = (sum(by["udp"]) / len(by["udp"])) / (sum(by["grpc"]) / len(by["grpc"]))
        lines += ["", f"CPU per beat, datagram / gRPC (mean of the trials): **{ratio:.2f}**"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from protocol.identity import Identity

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.heartbeat_transport", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rate", type=float, default=1500.0, help="heartbeats per second sent")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--trials", type=int, default=2, help="runs per transport, alternating")
    parser.add_argument("--keys", type=int, default=2000, help="admitted peers the beats come from")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.trials < 1 or args.keys < 1:
        parser.error("--rate, --seconds, --trials and --keys must be positive")
    keys = [Identity.generate() for _ in range(args.keys)]
    results = []
    for trial in range(1, args.trials + 1):
        for transport in ("grpc", "udp"):
            print(f"trial {trial}, {transport} ...", file=sys.stderr, flush=True)
            results.append({**one_run(transport, args, keys), "trial": trial})
    label = datetime.date.today().isoformat() + (f"-{args.label}" if args.label else "")
    command = " ".join(["python -m benchmarks.heartbeat_transport", *(argv if argv is not None else sys.argv[1:])])
    header = (
        f"Heartbeat transport, {label}, {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), `{command}`\n\n"
        f"One heartbeat process (`coordinator.front`) admitting {args.keys} peers; {args.rate:g} signed heartbeats a "
        f"second for {args.seconds:g} s per run from one sender process on loopback, which shares the machine's cores."
    )
    text = markdown(results, header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"heartbeat-transport-{label}.md").write_text(text)
    (args.out / f"heartbeat-transport-{label}.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=2, default=str)
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
