"""A splice beside a busy trainer, against the link: ``python -m benchmarks.splice_busy``.

    sudo .venv/bin/python -m benchmarks.splice_busy --link 1gbit --megabytes 200

Three hosts in network namespaces (``benchmarks.netsim``), every link at ``--link`` both ways:
``src`` sends ``--megabytes`` over one TCP connection to ``sink``, which answers one byte once it
holds them all; the time is from the connect to that byte. Three ways, one after another, each
``--runs`` times, in one run of this command:

- ``direct``: ``src`` to ``sink`` (what the link carries: the baseline);
- ``in-loop``: through ``mid``, which splices the two connections on an asyncio loop of its own
  process (``relay.wire.pipe_both``, as relay tunnels, punched connections and a volunteer's
  relay did) while a Python thread there computes without pause (a trainer's Python work);
- ``process``: the same, the splice handed to a splice process (``relay.splicer``, as a peer
  does now).

Each splice row is a % of ``direct``'s median in the same run. Writes
``splice-busy-<label>.{md,json}`` under ``--out``. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.netsim import NotRootError, WanSim, parse_rate

WAYS = ("direct", "in-loop", "process")
SINK_PORT, MID_PORT = 9200, 9201
CHUNK = 1 << 20


def _busy(stop: threading.Event) -> None:
    """A trainer's Python work: pure-Python arithmetic, holding the interpreter between switches."""
    total = 0
    while not stop.is_set():
        for i in range(10_000):
            total += i * i


def _child_sink(args: argparse.Namespace) -> int:
    server = socket.create_server(("0.0.0.0", SINK_PORT), backlog=4)
    print("ready", flush=True)
    for _ in range(args.connections):
        conn, _ = server.accept()
        with conn:
            left = args.megabytes * CHUNK
            buffer = bytearray(CHUNK)
            while left > 0:
                got = conn.recv_into(buffer, min(CHUNK, left))
                if not got:
                    break
                left -= got
            conn.sendall(b"k")
    return 0


def _child_mid(args: argparse.Namespace) -> int:
    from relay.splicer import Splicer
    from relay.wire import pipe_both

    stop = threading.Event()
    threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    splicer = Splicer() if args.way == "process" else None
    done = 0

    async def main() -> None:
        finished = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal done
            far = await asyncio.open_connection(args.sink_ip, SINK_PORT)
            counts: tuple[list[int], list[int]] = ([0], [0])
            if splicer is not None:
                await splicer.pipe_both((reader, writer), far, counts)
            else:
                await pipe_both((reader, writer), far, counts)
            done += 1
            if done == args.connections:
                finished.set()

        server = await asyncio.start_server(serve, "0.0.0.0", MID_PORT)
        print("ready", flush=True)
        await finished.wait()
        server.close()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        if splicer is not None:
            splicer.close()
    return 0


def _child_src(args: argparse.Namespace) -> int:
    payload = os.urandom(CHUNK)
    times = []
    for _ in range(args.connections):
        started = time.perf_counter()
        with socket.create_connection((args.target_ip, args.target_port)) as conn:
            for _ in range(args.megabytes):
                conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise RuntimeError("the sink did not confirm")
        times.append(time.perf_counter() - started)
    print(json.dumps(times), flush=True)
    return 0


def _wait_ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"{what} did not start: {line!r}")


def run_way(way: str, args: argparse.Namespace) -> list[float]:
    """Seconds per transfer of ``way`` over a fresh simulator."""
    with WanSim(["src", "mid", "sink"], rate=args.link) as sim:
        base = [sys.executable, "-m", "benchmarks.splice_busy", "--megabytes", str(args.megabytes)]
        base += ["--connections", str(args.runs), "--way", way]
        sink = sim.run("sink", [*base, "--child", "sink"], stdout=subprocess.PIPE, text=True)
        _wait_ready(sink, "the sink")
        target = (sim.ip("sink"), SINK_PORT)
        mid = None
        if way != "direct":
            mid = sim.run(
                "mid", [*base, "--child", "mid", "--sink-ip", sim.ip("sink")], stdout=subprocess.PIPE, text=True
            )
            _wait_ready(mid, "the splicing host")
            target = (sim.ip("mid"), MID_PORT)
        src = sim.run(
            "src",
            [*base, "--child", "src", "--target-ip", target[0], "--target-port", str(target[1])],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = src.communicate(timeout=args.timeout)
        if src.returncode != 0:
            raise RuntimeError(f"{way}: the sender exited {src.returncode}")
        for proc in (sink, mid):
            if proc is not None:
                proc.wait(timeout=30)
        return [float(t) for t in json.loads(out.strip().splitlines()[-1])]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.splice_busy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="1gbit", help="every host's link rate, both directions (tc units)")
    parser.add_argument("--megabytes", type=int, default=200, help="MiB per transfer")
    parser.add_argument("--runs", type=int, default=3, help="transfers per way")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="")
    parser.add_argument("--child", choices=("sink", "mid", "src"), help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, default="direct", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--sink-ip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--target-ip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--target-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.megabytes < 1 or args.runs < 1:
        parser.error("--megabytes and --runs must be positive")
    try:
        parse_rate(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "sink":
        return _child_sink(args)
    if args.child == "mid":
        return _child_mid(args)
    if args.child == "src":
        return _child_src(args)
    try:
        WanSim(["check"], rate=args.link)
    except NotRootError as exc:
        print(f"splice_busy: {exc}", file=sys.stderr)
        return 2
    seconds: dict[str, list[float]] = {}
    for way in WAYS:
        print(f"{way}: {args.runs} transfers of {args.megabytes} MiB ...", file=sys.stderr, flush=True)
        seconds[way] = run_way(way, args)
    bits = args.megabytes * CHUNK * 8
    link_bps = parse_rate(args.link)
    direct = statistics.median(seconds["direct"])
    rows: dict[str, dict[str, Any]] = {}
    for way, times in seconds.items():
        median = statistics.median(times)
        rows[way] = {
            "median_s": median,
            "mbit_s": bits / median / 1e6,
            "pct_of_link_rate": 100.0 * bits / median / link_bps,
            "pct_of_direct": 100.0 * direct / median,
            "seconds": times,
        }
    label = datetime.date.today().isoformat() + (f"-{args.label}" if args.label else "")
    command = " ".join(["python -m benchmarks.splice_busy", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"A splice beside a busy trainer, {label}, {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), `{command}`",
        "",
        f"Every link at {args.link} both ways; {args.megabytes} MiB per transfer, {args.runs} transfers per way; "
        "the splicing host runs a pure-Python thread without pause beside its splice.",
        "",
        "| way | median s | Mbit/s | % of the link's rate | % of direct | transfers (s) |",
        "|---|---|---|---|---|---|",
    ]
    for way, row in rows.items():
        each = " ".join(f"{t:.2f}" for t in row["seconds"])
        lines.append(
            f"| {way} | {row['median_s']:.2f} | {row['mbit_s']:.0f} | {row['pct_of_link_rate']:.0f}% "
            f"| {row['pct_of_direct']:.0f}% | {each} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"splice-busy-{label}.md").write_text(text)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "command": command, "rows": rows}
    (args.out / f"splice-busy-{label}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
