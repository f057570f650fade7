"""swarmtrain over a simulated WAN: every peer in its own network namespace behind a
rate-limited link (``benchmarks.netsim``), one configuration after another, same seeds,
same data, same links.

    sudo .venv/bin/python -m benchmarks.wan --peers 4 --link 20mbit [--rounds 6]

Configurations: two hivemind.Optimizer baselines (``benchmarks.baseline_hivemind``:
synchronous data parallel, and ``use_local_updates=True`` averaging every H steps), then
swarmtrain with fp32, fp16, int8, 4-bit and sparse (1/4, 2-bit) averaging (overlap on), and fp32 and int8 with
overlap off; on request (``--only``) "fp32 node of 2 ranks", fp32 with the first peer a node of
two local ranks (``--nproc-per-node 2``), to compare its WAN averaging with fp32's. For each: compute utilization, swarm samples/s, bytes each peer put on its
link (kernel counters of the simulated link) per round and per sample, all-reduce time vs.
the link bound 2·(n−1)/n·S/B, and the loss after the last round; equal rounds are equal
samples (``benchmarks.wan_figures``). Then a late joiner's time to ready against the time
the state (θ_g + momentum, 8 bytes a parameter) takes over its link. Writes
``wan-<date>.md``/``.json`` and, with matplotlib (``pip install .[bench]``), PNG plots
under ``--out`` (default ``benchmarks/results``). Needs root (namespaces); says so and
exits 2 otherwise. Tears down its namespaces and processes on any exit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.netsim import NotRootError, WanSim, parse_rate
from benchmarks.wan_figures import Figures, figures, markdown_table
from swarmtrain.localswarm import swarmtrain_executable

logger = logging.getLogger(__name__)

SPEC = """
[run]
name = "wan-{name}"
[task.model]
d_model = {d_model}
n_layers = {layers}
n_heads = 4
context = 64
[inner]
lr = 2e-3
batch_size = 8
[rounds]
{rounds}
[averaging]
compression = "{codec}"
overlap = {overlap}{in_turn}
min_group_size = {peers}
matchmaking_timeout_s = 15.0
allreduce_timeout_s = 120.0
{outer}"""
CONFIGS = [  # name, kind, codec, overlap
    ("hivemind sync DP", "sync", "none", False),
    ("hivemind local-SGD", "local", "none", False),
    ("fp32", "swarmtrain", "none", True),
    ("fp16", "swarmtrain", "fp16", True),
    ("int8", "swarmtrain", "int8", True),
    ("4bit", "swarmtrain", "4bit", True),
    ("sparse", "swarmtrain", "sparse", True),
    ("fp32 no-overlap", "swarmtrain", "none", False),
    ("int8 no-overlap", "swarmtrain", "int8", False),
    ("int8 whole-vector overlap", "swarmtrain", "int8", True),
    ("fp32 node of 2 ranks", "swarmtrain", "none", True),
]
IN_TURN = {"int8 whole-vector overlap": 1}
"""Configurations that set ``averaging.sync_fragments`` (with overlap, unset is 4 fragments in turn)."""
NODE_RANKS = {"fp32 node of 2 ranks": 2}
"""Configurations whose first peer is a node of several local ranks (``--nproc-per-node``; the
others keep one): its WAN averaging against fp32's, same state size (issue #13)."""


class _Peer:
    def __init__(self, sim: WanSim, host: str, argv: list[str], log: Path) -> None:
        self.lines: list[str] = []
        self.times: list[float] = []
        self.started = time.monotonic()
        self.proc = sim.run(
            host,
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self._log.open("w") as out:
            for line in self.proc.stdout:
                self.times.append(time.monotonic())
                self.lines.append(line.rstrip("\n"))
                out.write(line)

    def maddr(self, ip: str, deadline_s: float = 120.0) -> str:
        pattern = re.compile(rf"^listening: (/ip4/{re.escape(ip)}/\S+)$")
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.lines):
                match = pattern.match(line)
                if match:
                    return match.group(1)
            time.sleep(0.2)
        raise RuntimeError(f"the first peer printed no multiaddr; see {self._log}")


def _write_spec(workdir: Path, name: str, codec: str, overlap: bool, args: argparse.Namespace) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(
        SPEC.format(
            name=re.sub(r"[^a-z0-9._-]", "-", name.lower()),
            d_model=args.d_model,
            layers=args.layers,
            rounds=(
                f"inner_steps = 100000\ntime_budget_s = {args.time_budget}"
                if args.time_budget
                else f"inner_steps = {args.steps}"
            ),
            codec=codec,
            overlap=str(overlap).lower(),
            in_turn=f"\nsync_fragments = {IN_TURN[name]}" if name in IN_TURN else "",
            peers=args.peers,
            # sparse's measured best outer lr (protocol.spec: AveragingSection.bits); the others keep 0.7
            outer="[outer]\nlr = 1.0\n" if codec == "sparse" else "",
        )
    )
    return spec


def _argv(
    kind: str, spec: Path, host: str, ip: str, i: int, args: argparse.Namespace, workdir: Path, rounds: int
) -> list[str]:
    metrics = ["--metrics-file", str(workdir / f"{host}.jsonl")]
    if kind == "swarmtrain":
        return [
            *swarmtrain_executable(),
            "peer",
            "--spec",
            str(spec),
            "--host",
            ip,
            "--device",
            "cpu",
            "--key",
            str(workdir / f"{host}.key"),
            "--shard-seed",
            str(i),
            "--max-rounds",
            str(rounds),
            *metrics,
        ]
    return [
        sys.executable,
        "-m",
        "benchmarks.baseline_hivemind",
        "--spec",
        str(spec),
        "--mode",
        kind,
        "--peers",
        str(args.peers),
        "--host",
        ip,
        "--shard-seed",
        str(i),
        "--rounds",
        str(rounds),
        *metrics,
    ]


def _link_bytes(sim: WanSim, host: str) -> int:
    """Bytes ``host`` has sent: what its link's bridge end has received."""
    return int(Path(f"/sys/class/net/{sim.names.bridge_if[host]}/statistics/rx_bytes").read_text())


def run_config(
    name: str, kind: str, codec: str, overlap: bool, args: argparse.Namespace, workdir: Path
) -> tuple[Figures, list[list[dict[str, Any]]]]:
    spec = _write_spec(workdir, name, codec, overlap, args)
    hosts = [f"p{i}" for i in range(args.peers)]
    with WanSim(hosts, rate=args.link, delay_ms=args.delay_ms) as sim:
        before = {host: _link_bytes(sim, host) for host in hosts}
        peers: list[_Peer] = []
        for i, host in enumerate(hosts):
            argv = _argv(kind, spec, host, sim.ip(host), i, args, workdir, args.rounds)
            if i == 0 and name in NODE_RANKS:
                argv += ["--nproc-per-node", str(NODE_RANKS[name])]
            if peers:
                argv += ["--initial-peers", peers[0].maddr(sim.ip(hosts[0]))]
            peers.append(_Peer(sim, host, argv, workdir / f"{host}.log"))
        deadline = time.monotonic() + args.timeout
        for peer, host in zip(peers, hosts):
            left = max(1.0, deadline - time.monotonic())
            if peer.proc.wait(timeout=left) != 0:
                raise RuntimeError(f"{name}: peer {host} failed; see {workdir / (host + '.log')}")
        sent = [_link_bytes(sim, host) - before[host] for host in hosts]
    histories = [_rows(workdir / f"{host}.jsonl") for host in hosts]
    result = figures(name, histories, codec=codec, link_bps=float(parse_rate(args.link)), link_bytes=sent)
    return result, histories


ADOPTED = re.compile(r"adopted the swarm's state of round")
ROW_KEYS = ("round", "samples", "loss", "compute_s", "wait_s", "host_s", "digest_s", "allreduce_s", "averaged")
"""The per-round fields each peer's rows keep in the JSON result."""


def late_joiner(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Start a peer once the swarm has trained a round; seconds until it holds the swarm's
    verified state, from its start and from its first DHT contact, vs. the state's transfer time."""
    spec = _write_spec(workdir, "late-join", "int8", True, args)
    hosts = [f"p{i}" for i in range(args.peers)] + ["late"]
    with WanSim(hosts, rate=args.link, delay_ms=args.delay_ms) as sim:
        peers: list[_Peer] = []
        for i, host in enumerate(hosts[:-1]):
            argv = _argv("swarmtrain", spec, host, sim.ip(host), i, args, workdir, 10_000)
            if peers:
                argv += ["--initial-peers", peers[0].maddr(sim.ip(hosts[0]))]
            peers.append(_Peer(sim, host, argv, workdir / f"{host}.log"))
        first = workdir / "p0.jsonl"
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and not (first.exists() and first.read_text().strip()):
            time.sleep(0.5)
        argv = _argv("swarmtrain", spec, "late", sim.ip("late"), 99, args, workdir, 1)
        argv += ["--initial-peers", peers[0].maddr(sim.ip(hosts[0])), "--wait-for-group", "0", "-v"]
        late = _Peer(sim, "late", argv, workdir / "late.log")
        while time.monotonic() < deadline and not any(ADOPTED.search(line) for line in late.lines):
            if late.proc.poll() is not None:
                raise RuntimeError(f"the late joiner exited; see {workdir / 'late.log'}")
            time.sleep(0.2)
        index = next(i for i, line in enumerate(late.lines) if ADOPTED.search(line))
        listening = next(i for i, line in enumerate(late.lines) if line.startswith("listening: "))
        params = _rows(first)[0]["params"]
        return {
            "ready_s": late.times[index] - late.started,
            "ready_after_dht_s": late.times[index] - late.times[listening],
            "state_bytes": 8 * params,
            "transfer_bound_s": 8 * params * 8 / parse_rate(args.link),
        }


def plots(results: list[tuple[Figures, list[list[dict[str, Any]]]]], out: Path, stamp: str) -> list[Path]:
    """Loss vs. wall time and utilization bars as PNG; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install .[bench]): no plots", flush=True)
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    for result, histories in results:
        rows, wall = histories[0], 0.0
        xs, ys = [], []
        for row in rows:
            wall += row["wall_s"]
            if math.isfinite(row["loss"]):  # a round joined with no steps measured no loss
                xs.append(wall)
                ys.append(row["loss"])
        ax.plot(xs, ys, marker=".", label=result.name)
    ax.set_xlabel("wall time of peer 0 (s)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    loss_png = out / f"wan-{stamp}-loss.png"
    fig.tight_layout()
    fig.savefig(loss_png, dpi=110)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r.name for r, _ in results]
    ax.barh(names, [100 * r.utilization for r, _ in results])
    ax.set_xlabel("compute utilization (%)")
    ax.set_xlim(0, 100)
    util_png = out / f"wan-{stamp}-utilization.png"
    fig.tight_layout()
    fig.savefig(util_png, dpi=110)
    return [loss_png, util_png]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--link", default="20mbit", help="each peer's link rate, both directions (tc units)")
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way delay added on each peer's link, each direction (benchmarks.delay_link): two peers' RTT is 4x it",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds of inner steps per round instead of --steps (every peer trains as long: "
        "peers of unequal speed launch together)",
    )
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="run only these configurations (names)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="", help="suffix of the result files (wan-<date>-<label>.md)")
    parser.add_argument("--keep-logs", action="store_true", help="keep every peer's log (the path is printed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.peers < 2:
        parser.error("--peers must be >= 2")
    if args.time_budget < 0:
        parser.error("--time-budget must be >= 0")
    if args.time_budget and any(
        kind != "swarmtrain" for name, kind, *_ in CONFIGS if not args.only or name in args.only
    ):
        parser.error(
            "--time-budget applies to swarmtrain's configurations only (the hivemind baselines count steps); pick them with --only"
        )
    try:
        parse_rate(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        WanSim(["check"], rate=args.link, delay_ms=args.delay_ms)  # refuses early (not root, no ip/tc) before any work
    except NotRootError as exc:
        print(f"benchmarks.wan: error: {exc}", file=sys.stderr)
        return 2
    runs: list[tuple[Figures, list[list[dict[str, Any]]]]] = []
    late: dict[str, float] = {}
    tmp = tempfile.mkdtemp(prefix="swarmtrain-wan-")
    try:
        for name, kind, codec, overlap in CONFIGS:
            if (args.only and name not in args.only) or (not args.only and name in NODE_RANKS):
                continue
            print(
                f"running {name} ({args.peers} peers, {args.link} links, RTT {4 * args.delay_ms:g} ms)...", flush=True
            )
            runs.append(run_config(name, kind, codec, overlap, args, Path(tmp) / name.replace(" ", "-")))
            print(f"  {runs[-1][0]}", flush=True)
        if not args.only or "late-join" in args.only:
            print("running late-join...", flush=True)
            late = late_joiner(args, Path(tmp) / "late-join")
            print(f"  {late}", flush=True)
    except BaseException:
        print(f"logs of the failed run kept in {tmp}", file=sys.stderr)
        raise
    if args.keep_logs:
        print(f"logs kept in {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    results = [r for r, _ in runs]
    table = markdown_table(results, reference="fp32")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d") + (f"-{args.label}" if args.label else "")
    command = " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"swarmtrain WAN benchmark, {stamp}, {platform.node()} ({os.cpu_count()} CPUs, CPU peers, "
        f"OMP_NUM_THREADS=1), `python -m benchmarks.wan {command}`".replace("wan ` ", "wan`")
        + (f"; links {args.link} with {4 * args.delay_ms:g} ms RTT between peers" if args.delay_ms else "")
    )
    regime = ""
    fp32 = next((r for r in results if r.name == "fp32"), None)
    if fp32 is not None and fp32.link_bound_s > 0:
        rows = [r for peer in next(h for f, h in runs if f is fp32) for r in peer[1:]]
        compute = sorted(r["compute_s"] for r in rows)[len(rows) // 2] if rows else 0.0
        regime = (
            f"\n\nRegime: a round computes {compute:.1f} s (median), {compute / fp32.link_bound_s:.1f}x the fp32 "
            f"link bound of {fp32.link_bound_s:.2f} s."
        )
    late_text = ""
    if late:
        late_text = (
            f"\n\nLate joiner: ready {late['ready_s']:.1f} s after start ({late['ready_after_dht_s']:.1f} s "
            f"after its DHT node was up); its state is {late['state_bytes'] / 1e6:.1f} MB, "
            f"{late['transfer_bound_s']:.1f} s at {args.link}."
        )
    args.out.mkdir(parents=True, exist_ok=True)
    pngs = plots(runs, args.out, stamp) if runs else []
    (args.out / f"wan-{stamp}.md").write_text(header + regime + "\n\n" + table + late_text + "\n")
    (args.out / f"wan-{stamp}.json").write_text(
        json.dumps(
            {
                "date": stamp,
                "command": command,
                "peers": args.peers,
                "link": args.link,
                "delay_ms": args.delay_ms,
                "late_joiner": late,
                "results": [r.as_dict() for r in results],
                "rounds": {
                    figs.name: [[{k: row.get(k) for k in ROW_KEYS} for row in peer] for peer in histories]
                    for figs, histories in runs
                },
                "plots": [p.name for p in pngs],
            },
            indent=1,
        )
    )
    print(header)
    print(table + late_text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
