"""Averaging alone over the simulated WAN, against what the links carry for plain TCP and for
libp2p streams moving the same bytes (issue #12): ``python -m benchmarks.wan_averaging``.

    sudo .venv/bin/python -m benchmarks.wan_averaging --peers 4 --link 50mbit --values 10400000

Three transports, one after another, each in a fresh simulator (``benchmarks.netsim``), same
peers, same links, same rounds, no training:

- ``tcp``: every host sends ``2·S/n`` bytes to each of the other hosts over one persistent
  kernel TCP connection per pair: the bytes a bandwidth-optimal all-reduce puts on each link
  (``2·(n−1)/n·S``), with nothing but TCP between them;
- ``libp2p``: the same bytes over hivemind's p2pd, two streams per pair and round (a butterfly
  all-reduce has two: parts to the reducer, averaged parts back), 1 MiB messages;
- ``swarmtrain``: ``ExactAverager`` rounds of a vector of ``S`` bytes (the codec's wire size);
  with ``--streams K``, the spec's ``averaging.streams = K``: one group, the vector cut into K
  fragments (``engine.fragments``) averaged at once, each over its own streams; with
  ``--robust off on``, one run each without and with the spec's default robust averaging
  (``engine.robust``: what bounding every member's contribution costs in averaging time).
  Each host's vector is a shared direction plus its own noise, as members' pseudo-gradients
  are (uncorrelated vectors would have robust averaging leave half of them out). Its parts go
  over the bulk channel (the shipped default; ``engine.bulk_channel``: one TLS connection per
  pair of hosts, carrying both hosts' calls, every fragment's, kept between rounds); with
  ``--bulk off`` over libp2p streams alone, with ``--bulk on off`` one run each. A bulk run whose parts went over libp2p
  to any reducer fails rather than be counted. Each
  swarmtrain run begins with one round that is not timed, in which the connections are made
  (tcp's are made before its first round).

A round starts when every host is ready (a file barrier) and ends when the last host holds
everything it should receive; swarmtrain's round is its all-reduce time (``allreduce_s``,
the slowest member). The figures: median round seconds, % of the link bound
``2·(n−1)/n·S/B`` at the nominal rate B, and swarmtrain's time as a ratio to tcp's and
libp2p's in the same run. Writes ``wan-averaging-<label>.{md,json}`` under ``--out``.
Needs root (namespaces).
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
import tempfile
import threading
import time
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from benchmarks.delay_link import validate_delay_ms
from benchmarks.netsim import NotRootError, WanSim, parse_rate
from benchmarks.wan_figures import WIRE_BYTES_PER_VALUE, link_bound_s

TRANSPORTS = ("tcp", "libp2p", "swarmtrain")
MESSAGE_BYTES = 1 << 20
TCP_PORT = 9100


def per_pair_bytes(values: int, codec: str, peers: int) -> int:
    """Bytes each host sends to each other host per round: ``2·S/n`` (parts out, averages back)."""
    return int(2 * values * WIRE_BYTES_PER_VALUE[codec] / peers)


def _barrier(workdir: Path, name: str, index: int, peers: int, timeout: float = 300.0) -> None:
    (workdir / f"{name}.{index}").touch()
    deadline = time.monotonic() + timeout
    while sum(1 for i in range(peers) if (workdir / f"{name}.{i}").exists()) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every host arrived in {timeout} s")
        time.sleep(0.005)


def _publish(workdir: Path, name: str, text: str) -> None:
    tmp = workdir / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, workdir / name)


def _read_published(workdir: Path, name: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not (workdir / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} was not published in {timeout} s")
        time.sleep(0.02)
    return (workdir / name).read_text()


# ----------------------------------------------------------------------------- children


def _child_tcp(args: argparse.Namespace, workdir: Path) -> list[float]:
    ips = args.ips.split(",")
    per_pair = per_pair_bytes(args.values, args.codec, args.peers)
    expected = per_pair * (args.peers - 1)
    received = [0]
    lock = threading.Condition()
    server = socket.create_server((ips[args.index], TCP_PORT), backlog=args.peers)

    def reader(conn: socket.socket) -> None:
        while chunk := conn.recv(1 << 20):
            with lock:
                received[0] += len(chunk)
                lock.notify_all()

    def accept() -> None:
        for _ in range(args.peers - 1):
            conn, _addr = server.accept()
            threading.Thread(target=reader, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    _barrier(workdir, "listening", args.index, args.peers)
    conns = [socket.create_connection((ip, TCP_PORT)) for i, ip in enumerate(ips) if i != args.index]
    payload = memoryview(b"\x01" * MESSAGE_BYTES)
    times = []
    for r in range(args.rounds):
        _barrier(workdir, f"round{r}", args.index, args.peers)
        started = time.monotonic()

        def send(conn: socket.socket) -> None:
            left = per_pair
            while left > 0:
                n = min(left, MESSAGE_BYTES)
                conn.sendall(payload[:n])
                left -= n

        senders = [threading.Thread(target=send, args=(c,)) for c in conns]
        for t in senders:
            t.start()
        with lock:
            lock.wait_for(lambda r=r: received[0] >= expected * (r + 1), timeout=args.timeout)
        for t in senders:
            t.join()
        times.append(time.monotonic() - started)
    _barrier(workdir, "done", args.index, args.peers)
    return times


class _Sink(ServicerBase):
    """Counts the bytes every incoming stream carries."""

    def __init__(self) -> None:
        self.received = [0]
        self.arrived = asyncio.Condition()

    # hivemind tells streaming handlers by ``typing.AsyncIterator`` annotations
    async def rpc_sink(
        self, stream: typing.AsyncIterator[runtime_pb2.Tensor], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.Tensor]:
        async for message in stream:
            async with self.arrived:
                self.received[0] += len(message.buffer)
                self.arrived.notify_all()
        yield runtime_pb2.Tensor()


async def _child_libp2p(args: argparse.Namespace, workdir: Path) -> list[float]:
    per_stream = per_pair_bytes(args.values, args.codec, args.peers) // 2
    expected = 2 * per_stream * (args.peers - 1)
    sink = _Sink()
    received, arrived = sink.received, sink.arrived

    earlier = [json.loads(_read_published(workdir, f"maddrs.{i}")) for i in range(args.index)]
    p2p = await P2P.create(
        host_maddrs=[f"/ip4/{args.ips.split(',')[args.index]}/tcp/0"],
        initial_peers=[m for maddrs in earlier for m in maddrs],
    )
    try:
        await sink.add_p2p_handlers(p2p)
        _publish(workdir, f"maddrs.{args.index}", json.dumps([str(m) for m in await p2p.get_visible_maddrs()]))
        _publish(workdir, f"peer.{args.index}", p2p.peer_id.to_base58())
        others = [
            PeerID.from_base58(_read_published(workdir, f"peer.{i}")) for i in range(args.peers) if i != args.index
        ]
        await asyncio.get_running_loop().run_in_executor(None, _barrier, workdir, "listening", args.index, args.peers)
        payload = b"\x01" * MESSAGE_BYTES

        async def send(peer: Any) -> None:
            async def messages() -> AsyncIterator[runtime_pb2.Tensor]:
                left = per_stream
                while left > 0:
                    n = min(left, MESSAGE_BYTES)
                    yield runtime_pb2.Tensor(buffer=payload[:n])
                    left -= n

            async for _ in await _Sink.get_stub(p2p, peer).rpc_sink(messages()):
                pass

        times = []
        for r in range(args.rounds):
            await asyncio.get_running_loop().run_in_executor(
                None, _barrier, workdir, f"round{r}", args.index, args.peers
            )
            started = time.monotonic()
            await asyncio.gather(*(send(peer) for peer in others for _ in range(2)))
            async with arrived:
                await asyncio.wait_for(
                    arrived.wait_for(lambda r=r: received[0] >= expected * (r + 1)), timeout=args.timeout
                )
            times.append(time.monotonic() - started)
        await asyncio.get_running_loop().run_in_executor(None, _barrier, workdir, "done", args.index, args.peers)
        return times
    finally:
        await p2p.shutdown()


def _child_swarmtrain(args: argparse.Namespace, workdir: Path) -> list[float]:
    import torch
    from hivemind import DHT

    from engine.averager import ExactAverager
    from engine.bulk_settings import BulkSettings
    from engine.codecs import get_codec
    from engine.robust import RobustRule

    torch.set_num_threads(1)
    ip = args.ips.split(",")[args.index]
    initial = [] if args.index == 0 else json.loads(_read_published(workdir, "maddrs.0"))
    dht = DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial)
    if args.index == 0:
        _publish(workdir, "maddrs.0", json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    averager = ExactAverager(
        args.values,
        dht,
        codec=get_codec(args.codec),
        prefix="wan-averaging",
        start=True,
        min_group_size=args.peers,
        target_group_size=args.peers,
        min_matchmaking_time=3.0,
        request_timeout=2.0,
        allreduce_timeout=args.timeout,
        streams=args.streams[0],
        robust=RobustRule() if args.robust[0] == "on" else RobustRule.off(),
        bulk=BulkSettings(enabled=args.bulk[0] == "on"),
    )
    try:
        with averager.get_tensors() as tensors:
            shared = torch.randn(args.values, generator=torch.Generator().manual_seed(12345))
            own = torch.randn(args.values, generator=torch.Generator().manual_seed(args.index))
            tensors[0].copy_(shared.add_(own, alpha=0.5))
        _barrier(workdir, "listening", args.index, args.peers)
        times: list[float | None] = []
        # one round first, not timed: the peers' libp2p connections (and the bulk channel's)
        # are made there, as tcp's are before its first round
        averager.step(gather={}, timeout=args.timeout)
        for round_ in range(args.rounds):
            outcome = averager.step(gather={}, timeout=args.timeout)
            stats = outcome.stats
            if outcome.failed or stats.missing:  # a failed round: counted as such, not timed
                why = outcome.failed or f"{len(stats.missing)} ranges missing"
                print(f"round {round_} failed on host {args.index}: {why}", file=sys.stderr, flush=True)
                times.append(None)
                continue
            if stats.streams != args.streams[0]:
                raise RuntimeError(f"averaged in {stats.streams} streams, asked for {args.streams[0]}")
            others = set(stats.peer_ids) - {str(dht.peer_id)}
            if args.bulk[0] == "on" and set(stats.over_bulk) != others:
                raise RuntimeError(
                    f"parts to {sorted(others - set(stats.over_bulk))} went over libp2p, not the bulk channel"
                )
            times.append(stats.allreduce_s)
        return times
    finally:
        averager.shutdown()
        dht.shutdown()


def _child(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    times: list[float | None] | list[float]
    if args.child == "tcp":
        times = _child_tcp(args, workdir)
    elif args.child == "libp2p":
        times = asyncio.run(_child_libp2p(args, workdir))
    else:
        times = _child_swarmtrain(args, workdir)
    print(json.dumps({"index": args.index, "times": times}), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of this machine so far, all cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The machine's CPU use between two ``cpu_ticks`` readings, in % of all its cores."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


def tcp_counters(snmp: str) -> tuple[int, int]:
    """(segments sent, segments retransmitted) from a network namespace's ``/proc/net/snmp``."""
    header, values = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:")][:2]
    row = dict(zip(header, values, strict=True))
    return int(row["OutSegs"]), int(row["RetransSegs"])


def retransmitted_pct(sim: WanSim, hosts: list[str]) -> float:
    """TCP segments retransmitted, % of those sent, by every host of ``sim`` since it started
    (each host's namespace counts its own)."""
    sent = retransmitted = 0
    for host in hosts:
        proc = sim.run(host, ["cat", "/proc/net/snmp"], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=30)
        host_sent, host_retransmitted = tcp_counters(out)
        sent, retransmitted = sent + host_sent, retransmitted + host_retransmitted
    return 100.0 * retransmitted / sent if sent else 0.0


def run_transport(
    transport: str,
    args: argparse.Namespace,
    streams: int = 1,
    robust: str = "off",
    cpu: list[float] | None = None,
    bulk: str = "off",
    retransmits: list[float] | None = None,
) -> list[float]:  # the rounds that completed on every host
    """Round times (the slowest host's) of ``transport`` over a fresh simulator; appends the
    machine's CPU use while the hosts ran (% of all cores) to ``cpu``, and the TCP segments the
    hosts retransmitted (% of those sent) to ``retransmits``."""
    hosts = [f"h{i}" for i in range(args.peers)]
    sim_ = WanSim(hosts, rate=args.link, delay_ms=args.delay_ms)
    with tempfile.TemporaryDirectory(prefix="wan-averaging-") as tmp, sim_ as sim:
        os.chmod(tmp, 0o755)
        ips = ",".join(sim.ip(h) for h in hosts)
        procs = []
        for i, host in enumerate(hosts):
            argv = [sys.executable, "-m", "benchmarks.wan_averaging", "--child", transport, "--index", str(i)]
            argv += ["--ips", ips, "--workdir", tmp, "--peers", str(args.peers), "--values", str(args.values)]
            argv += ["--codec", args.codec, "--rounds", str(args.rounds), "--timeout", str(args.timeout)]
            argv += ["--streams", str(streams), "--robust", robust, "--bulk", bulk]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            with open(Path(tmp) / f"{host}.log", "w") as log:
                procs.append(sim.run(host, argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        per_host = []
        ticks = cpu_ticks()
        deadline = time.monotonic() + args.timeout * (args.rounds + 1)
        for host, proc in zip(hosts, procs):
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                for other in hosts:  # every host's view of what went wrong, the failed one's last
                    log_tail = (Path(tmp) / f"{other}.log").read_text().splitlines()[-40:]
                    print(f"--- {other}'s log (last 40 lines)", *log_tail, sep="\n", file=sys.stderr)
                tail = (Path(tmp) / f"{host}.log").read_text().splitlines()[-15:]
                raise RuntimeError(f"{transport}: host {host} exited {proc.returncode}:\n" + "\n".join(tail))
            line = [x for x in out.splitlines() if x.startswith("{")][-1]
            per_host.append(json.loads(line)["times"])
        if cpu is not None:
            cpu.append(busy_pct(ticks, cpu_ticks()))
        if retransmits is not None:
            retransmits.append(retransmitted_pct(sim, hosts))
    return slowest_host(per_host)


def slowest_host(per_host: list[list[float | None]]) -> list[float]:
    """Each round's time: the slowest host's; a round that failed on any host (None) is left
    out (the result counts it in ``failed_rounds``)."""
    rounds = list(zip(*per_host, strict=True))
    return [max(t for t in times if t is not None) for times in rounds if None not in times]


def summarize(rounds: dict[str, list[float]], *, bound_s: float) -> dict[str, dict[str, float]]:
    """Median round seconds, % of the link bound and ratios to tcp/libp2p per transport."""
    medians = {t: statistics.median(times) for t, times in rounds.items()}
    out = {}
    for transport, times in rounds.items():
        row = {"median_s": medians[transport], "min_s": min(times), "max_s": max(times)}
        row["pct_of_link_bound"] = 100 * bound_s / medians[transport]
        for base in ("tcp", "libp2p"):
            if base in medians and base != transport:
                row[f"pct_of_{base}"] = 100 * medians[base] / medians[transport]
        out[transport] = row
    return out


def markdown(
    summary: dict[str, dict[str, float]],
    rounds: dict[str, list[float]],
    header: str,
    cpu: dict[str, float] | None = None,
    retransmits: dict[str, float] | None = None,
) -> str:
    """The result table; with ``cpu``, the machine's CPU use (% of all cores) while each ran; with
    ``retransmits``, the TCP segments its hosts retransmitted (% of those sent)."""
    cpu, retransmits = cpu or {}, retransmits or {}
    lines = [
        header,
        "",
        "| transport | median round s | min-max s | % of link bound | % of tcp | % of libp2p | CPU busy "
        "| TCP retransmitted | rounds (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for transport, row in summary.items():
        tcp = f"{row['pct_of_tcp']:.0f}%" if "pct_of_tcp" in row else "-"
        p2p = f"{row['pct_of_libp2p']:.0f}%" if "pct_of_libp2p" in row else "-"
        each = " ".join(f"{t:.2f}" for t in rounds[transport])
        busy = f"{cpu[transport]:.0f}%" if transport in cpu else "-"
        lost = f"{retransmits[transport]:.2f}%" if transport in retransmits else "-"
        lines.append(
            f"| {transport} | {row['median_s']:.2f} | {row['min_s']:.2f}-{row['max_s']:.2f} "
            f"| {row['pct_of_link_bound']:.0f}% | {tcp} | {p2p} | {busy} | {lost} | {each} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan_averaging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--link", default="50mbit", help="each host's link rate, both directions (tc units)")
    parser.add_argument("--values", type=int, default=10_400_000, help="values in the averaged vector")
    parser.add_argument("--codec", default="none", choices=sorted(WIRE_BYTES_PER_VALUE))
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way delay added on each host's link, each direction (benchmarks.delay_link): "
        "two hosts are 4x this apart in round-trip time",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--streams",
        type=int,
        nargs="+",
        default=[1],
        metavar="K",
        help="swarmtrain: fragments of the vector averaged at once (averaging.streams); several values: one run each",
    )
    parser.add_argument(
        "--robust",
        nargs="+",
        choices=("off", "on"),
        default=["off"],
        help="swarmtrain: without or with the spec's default robust averaging; several values: one run each",
    )
    parser.add_argument(
        "--bulk",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="swarmtrain: parts over the bulk channel (on, the shipped default) or libp2p streams alone (off); "
        "several values: one run each",
    )
    parser.add_argument("--only", nargs="*", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="", help="suffix of the result files")
    parser.add_argument("--child", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ips", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    if args.values < 1 or args.rounds < 1 or args.timeout <= 0 or not all(1 <= k <= 16 for k in args.streams):
        parser.error("--values, --rounds and --timeout must be positive, --streams in 1..16")
    try:
        parse_rate(args.link)
        validate_delay_ms(args.delay_ms)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _rtt_text(delay_ms: float) -> str:
    """How far apart the hosts are, for the result's header."""
    return f", {4 * delay_ms:g} ms round trip between two hosts ({delay_ms:g} ms one way per link)" if delay_ms else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args)
    try:
        WanSim(["check"], rate=args.link)
    except NotRootError as exc:
        print(f"wan_averaging: {exc}", file=sys.stderr)
        return 2
    rounds: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    retransmits: dict[str, float] = {}
    failed: dict[str, int] = {}
    for transport in args.only:
        variants = (
            [(k, r, b) for k in args.streams for r in args.robust for b in args.bulk]
            if transport == "swarmtrain"
            else [(1, "off", "off")]
        )
        for streams, robust, bulk in variants:
            details = [f"{streams} streams"] if streams > 1 else []
            details += ["robust"] if robust == "on" else []
            details += ["libp2p, no bulk channel"] if bulk == "off" and "on" in args.bulk else []
            details += ["bulk channel"] if bulk == "on" else []
            name = f"{transport} ({', '.join(details)})" if details else transport
            print(f"{name}: {args.rounds} rounds ...", file=sys.stderr, flush=True)
            used: list[float] = []
            resent: list[float] = []
            rounds[name] = run_transport(transport, args, streams, robust, cpu=used, bulk=bulk, retransmits=resent)
            cpu[name], retransmits[name] = used[0], resent[0]
            failed[name] = args.rounds - len(rounds[name])
            if not rounds[name]:
                raise RuntimeError(f"{name}: no round completed on every host")
    bound = link_bound_s(peers=args.peers, params=args.values, codec=args.codec, link_bps=parse_rate(args.link))
    summary = summarize(rounds, bound_s=bound)
    label = datetime.date.today().isoformat() + (f"-{args.label}" if args.label else "")
    command = " ".join(["python -m benchmarks.wan_averaging", *(argv if argv is not None else sys.argv[1:])])
    header = (
        f"swarmtrain averaging alone on the simulated WAN, {label}, {platform.node() or 'this machine'} "
        f"({os.cpu_count()} CPUs), `{command}`\n\n"
        f"{args.peers} hosts at {args.link} each way{_rtt_text(args.delay_ms)}, a vector of {args.values} values ({args.codec}): "
        f"{per_pair_bytes(args.values, args.codec, args.peers) * (args.peers - 1) / 1e6:.1f} MB on each link "
        f"per round; link bound {bound:.2f} s."
    )
    text = markdown(summary, rounds, header, cpu, retransmits)
    failures = [f"{name}: {n} of {args.rounds}" for name, n in failed.items() if n]
    text += f"\nRounds that failed on some host (left out above): {', '.join(failures)}.\n" if failures else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"wan-averaging-{label}.md").write_text(text)
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "bound_s": bound,
        "rounds": rounds,
        "cpu_busy_pct": cpu,
        "tcp_retransmitted_pct": retransmits,
    }
    (args.out / f"wan-averaging-{label}.json").write_text(json.dumps({**payload, "summary": summary}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
