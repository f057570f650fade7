"""swarmtrain over a simulated WAN: every peer in its own network namespace behind a
rate-limited link (``benchmarks.netsim``), one configuration after another, same seeds,
same data, same links.

    sudo .venv/bin/python -m benchmarks.wan --peers 4 --link 20mbit [--rounds 6]

Configurations: swarmtrain with fp32, fp16, int8 and 4-bit averaging (overlap on), and fp32
and int8 with overlap off. For each: compute utilization, swarm samples/s, bytes sent per
peer per round and per sample, all-reduce time vs. the link bound 2·(n−1)/n·S/B, and the
loss after the last round (``benchmarks.wan_figures``). Writes ``wan-<date>.md`` and
``.json`` under ``--out`` (default ``benchmarks/results``). Needs root (namespaces); says so
and exits 2 otherwise. Tears down its namespaces and processes on any exit.

Not yet here (issue #5): the hivemind.Optimizer baselines, late-joiner time to ready, and
the PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
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
inner_steps = {steps}
[averaging]
compression = "{codec}"
overlap = {overlap}
min_group_size = {peers}
target_group_size = {peers}
matchmaking_timeout_s = 15.0
allreduce_timeout_s = 120.0
"""
CONFIGS = [  # name, codec, overlap
    ("fp32", "none", True), ("fp16", "fp16", True), ("int8", "int8", True), ("4bit", "4bit", True),
    ("fp32 no-overlap", "none", False), ("int8 no-overlap", "int8", False),
]


class _Peer:
    def __init__(self, sim: WanSim, host: str, argv: list[str], log: Path) -> None:
        self.lines: list[str] = []
        self.proc = sim.run(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self._log.open("w") as out:
            for line in self.proc.stdout:
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


def run_config(name: str, codec: str, overlap: bool, args: argparse.Namespace, workdir: Path) -> Figures:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(SPEC.format(name=name.replace(" ", "-"), d_model=args.d_model, layers=args.layers,
                                steps=args.steps, codec=codec, overlap=str(overlap).lower(), peers=args.peers))
    hosts = [f"p{i}" for i in range(args.peers)]
    with WanSim(hosts, rate=args.link) as sim:
        peers: list[_Peer] = []
        for i, host in enumerate(hosts):
            argv = [*swarmtrain_executable(), "peer", "--spec", str(spec), "--host", sim.ip(host),
                    "--key", str(workdir / f"{host}.key"), "--shard-seed", str(i), "--max-rounds", str(args.rounds),
                    "--metrics-file", str(workdir / f"{host}.jsonl"), "--device", "cpu"]
            if peers:
                argv += ["--initial-peers", peers[0].maddr(sim.ip(hosts[0]))]
            peers.append(_Peer(sim, host, argv, workdir / f"{host}.log"))
        deadline = time.monotonic() + args.timeout
        for peer, host in zip(peers, hosts):
            left = max(1.0, deadline - time.monotonic())
            if peer.proc.wait(timeout=left) != 0:
                raise RuntimeError(f"{name}: peer {host} failed; see {workdir / (host + '.log')}")
    histories = [_rows(workdir / f"{host}.jsonl") for host in hosts]
    return figures(name, histories, codec=codec, link_bps=float(parse_rate(args.link)))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--link", default="20mbit", help="each peer's link rate, both directions (tc units)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="run only these configurations (names)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.peers < 2:
        parser.error("--peers must be >= 2")
    try:
        parse_rate(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    results: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-wan-") as tmp:
        for name, codec, overlap in CONFIGS:
            if args.only and name not in args.only:
                continue
            print(f"running {name} ({args.peers} peers, {args.link} links)...", flush=True)
            try:
                results.append(run_config(name, codec, overlap, args, Path(tmp) / name.replace(" ", "-")))
            except NotRootError as exc:
                print(f"benchmarks.wan: error: {exc}", file=sys.stderr)
                return 2
            print(f"  {results[-1]}", flush=True)
    table = markdown_table(results, reference="fp32")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = (f"swarmtrain WAN benchmark, {stamp}, {platform.node()} ({os.cpu_count()} CPUs), "
              f"`python -m benchmarks.wan {' '.join(argv if argv is not None else sys.argv[1:])}`")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"wan-{stamp}.md").write_text(header + "\n\n" + table + "\n")
    (args.out / f"wan-{stamp}.json").write_text(json.dumps(
        {"date": stamp, "peers": args.peers, "link": args.link, "results": [r.as_dict() for r in results]}, indent=1))
    print(header)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
