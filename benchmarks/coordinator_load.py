"""A coordinator under the load of a public run (issue #14): ``python -m benchmarks.coordinator_load``.

    sudo .venv/bin/python -m benchmarks.coordinator_load --peers 500 2000 --duration 120

A real ``swarmtrain coordinator`` process (PostgreSQL from ``.ci/postgres.sh`` when this
machine can run one, else ``--db`` or SQLite) and, in one load process, ``--peers`` simulated
peers on loopback, each with its own Ed25519 key: a signed join, a signed heartbeat every
``--interval`` s (the coordinator's default is 5), and every ``--round-s`` s a signed round
report from each peer, in groups of 4 that attest each other. Per peer count, after a warm-up
of one heartbeat interval, for ``--duration`` s:

- heartbeat latency (request to answer, seen by the load process) p50 / p99 / max;
- the coordinator process's CPU (``/proc/PID/stat``, user + system) as a share of one core;
- database rows written per hour (claims, credits, rounds, swarm samples);
- correctness: every peer online in status, every claim of the measured rounds granted with
  the samples reported.

The load process shares this machine's cores with the coordinator (and its database), so its
own CPU is reported too. Writes ``coordinator-load-<label>.{md,json}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GROUP = 4
SAMPLES = 64
SPEC = """
[run]
name = "load"
[credits]
max_samples_per_second = 1000.0
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def start_postgres(workdir: Path) -> str | None:
    """A throwaway PostgreSQL server's URL, or None where none can run here."""
    try:
        out = subprocess.run(
            ["bash", str(REPO / ".ci/postgres.sh"), "start", str(workdir / "pg"), "auto"],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"coordinator_load: no PostgreSQL here ({exc}); using SQLite", file=sys.stderr)
        return None
    return out.stdout.strip().splitlines()[-1]


async def run_load(address: str, digest: str, args: argparse.Namespace, peers: int) -> dict[str, Any]:
    """Join ``peers`` simulated peers, then heartbeat and report for the warm-up and ``--duration``."""
    import grpc

    from protocol import coordinator_pb2 as pb
    from protocol import coordinator_pb2_grpc as pb_grpc
    from protocol import kinds
    from protocol.identity import Identity
    from protocol.messages import sign_message

    keys = [Identity.generate() for _ in range(peers)]
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    joined = 0

    async def join(identity: Identity) -> None:
        nonlocal joined
        body = pb.JoinBody(
            libp2p_peer_id=f"12D3Koo{identity.public_key.id[8:20]}", software_version="load", spec_digest=digest
        )
        envelope = sign_message(identity, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto()
        await stub.Join(pb.JoinRequest(signed=envelope), timeout=60)
        joined += 1

    started = time.monotonic()
    for first in range(0, peers, 50):  # joins in batches: a public run's peers arrive over time
        await asyncio.gather(*(join(k) for k in keys[first : first + 50]))
    join_s = time.monotonic() - started

    latencies: list[tuple[float, float]] = []  # (when, seconds)
    errors: dict[str, int] = {}
    reported: dict[int, int] = {}  # round -> reports sent
    begin = time.monotonic()
    warm_up = args.interval
    end = begin + warm_up + args.duration

    async def heartbeat_loop(index: int, identity: Identity) -> None:
        await asyncio.sleep(args.interval * index / peers)
        round_ = 0
        # a group's members report each round together, the groups spread over the round
        next_report = begin + args.round_s * (1 + (index // GROUP % 10) / 10)
        while time.monotonic() < end:
            sent = time.monotonic()
            body = pb.HeartbeatBody(
                round=round_, phase=pb.PEER_PHASE_TRAINING, samples_per_second=5.0, samples_total=round_ * SAMPLES
            )
            envelope = sign_message(identity, kinds.HEARTBEAT, body.SerializeToString(), now=time.time()).to_proto()
            try:
                await stub.Heartbeat(pb.HeartbeatRequest(signed=envelope), timeout=30)
                latencies.append((sent - begin, time.monotonic() - sent))
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            if time.monotonic() >= next_report:
                round_ += 1
                await report(index, identity, round_)
                next_report += args.round_s
            await asyncio.sleep(max(0.0, sent + args.interval - time.monotonic()))

    async def report(index: int, identity: Identity, round_: int) -> None:
        first = index - index % GROUP
        members = keys[first : first + GROUP]
        group = [pb.GroupMember(public_key=m.public_key.raw, weight=SAMPLES) for m in members]
        body = pb.RoundReportBody(
            round=round_,
            samples=SAMPLES,
            loss=2.0,
            group=group,
            state_digest=f"blake3:{round_:064x}",
            compute_s=args.round_s,
        )
        envelope = sign_message(identity, kinds.ROUND_REPORT, body.SerializeToString(), now=time.time()).to_proto()
        try:
            await stub.ReportRound(pb.RoundReportRequest(signed=envelope), timeout=30)
            reported[round_] = reported.get(round_, 0) + 1
        except grpc.aio.AioRpcError as exc:
            errors["report " + exc.code().name] = errors.get("report " + exc.code().name, 0) + 1

    load_cpu = time.process_time()
    await asyncio.gather(*(heartbeat_loop(i, k) for i, k in enumerate(keys)))
    load_cpu = time.process_time() - load_cpu
    status = await stub.GetStatus(pb.StatusRequest(), timeout=30)
    await channel.close()
    measured = [s for when, s in latencies if when >= warm_up]
    halves = (
        [s for when, s in latencies if warm_up <= when < warm_up + args.duration / 2],
        [s for when, s in latencies if when >= warm_up + args.duration / 2],
    )
    return {
        "peers": peers,
        "joined": joined,
        "join_s": join_s,
        "heartbeats": len(measured),
        "heartbeats_per_s": len(measured) / args.duration,
        "p50_ms": 1000 * percentile(measured, 0.5),
        "p99_ms": 1000 * percentile(measured, 0.99),
        "max_ms": 1000 * max(measured, default=float("nan")),
        "p99_first_half_ms": 1000 * percentile(halves[0], 0.99),
        "p99_second_half_ms": 1000 * percentile(halves[1], 0.99),
        "errors": errors,
        "reported": reported,
        "peers_online": status.peers_online,
        "load_cpu_share": load_cpu / (warm_up + args.duration),
        "keys": [k.public_key.id for k in keys],
    }


def count_rows(db_url: str) -> dict[str, int]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return {
                table: int(conn.execute(sqlalchemy.text(f"SELECT count(*) FROM {table}")).scalar_one())
                for table in ("claims", "credits", "rounds", "swarm_samples", "peers")
            }
    finally:
        engine.dispose()


def one_run(peers: int, args: argparse.Namespace, db_url: str, workdir: Path) -> dict[str, Any]:
    from coordinator.store import Store
    from protocol.spec import parse_spec
    from swarmtrain.localswarm import LocalCoordinator, wait_until

    spec_path = workdir / "spec.toml"
    spec_path.write_text(SPEC)
    digest = parse_spec(SPEC).digest()
    # every simulated peer sends from 127.0.0.1: no per-source request limit
    extra = ["--archive-every", "0", "--max-requests-per-source", "0"]
    coordinator = LocalCoordinator(spec_path, workdir / "state", db_url=db_url, extra=extra, host="127.0.0.1")
    try:
        address = coordinator.address()
        rows_before = count_rows(db_url)
        cpu_before, wall_before = cpu_seconds(coordinator.proc.pid), time.monotonic()
        result = asyncio.run(run_load(address, digest, args, peers))
        wall = time.monotonic() - wall_before
        result["coordinator_cpu_share"] = (cpu_seconds(coordinator.proc.pid) - cpu_before) / wall
        store = Store(db_url)
        try:
            wait_until(lambda: not store.pending_claims(), 180, "every claim decided")
            rows_after = count_rows(db_url)
            keys = set(result.pop("keys"))
            claims = [c for c in store.claims(limit=10**7) if c.key in keys]
        finally:
            store.close()
        result["rows_per_hour"] = {t: (rows_after[t] - rows_before[t]) * 3600 / wall for t in rows_after}
        result["claims"] = len(claims)
        result["claims_granted_in_full"] = sum(
            1 for c in claims if c.status == "granted" and c.granted_samples == SAMPLES
        )
        result["claims_not_granted"] = [(c.round, c.status, c.reason[:120]) for c in claims if c.status != "granted"][
            :5
        ]
        return result
    finally:
        coordinator.stop()


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| peers | heartbeats/s | p50 ms | p99 ms | max ms | p99 1st / 2nd half ms | coordinator CPU (of 1 core) | load CPU | claims granted in full | errors | online |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['peers']} | {r['heartbeats_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.0f} "
            f"| {r['p99_first_half_ms']:.1f} / {r['p99_second_half_ms']:.1f} | {100 * r['coordinator_cpu_share']:.0f}% "
            f"| {100 * r['load_cpu_share']:.0f}% | {r['claims_granted_in_full']} of {r['claims']} | {sum(r['errors'].values())} "
            f"| {r['peers_online']} |"
        )
    lines += ["", "Database rows written per hour:", ""]
    for r in results:
        rows = ", ".join(f"{t} {v:,.0f}" for t, v in r["rows_per_hour"].items())
        lines.append(f"- {r['peers']} peers: {rows}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordinator_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[500, 2000], help="simulated peers; one run each")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a peer's heartbeats")
    parser.add_argument("--round-s", type=float, default=30.0, help="seconds between a peer's round reports")
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds per run")
    parser.add_argument("--db", default="", help="database URL (default: a throwaway PostgreSQL, else SQLite)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if not all(p >= GROUP and p % GROUP == 0 for p in args.peers):
        parser.error(f"--peers must be multiples of {GROUP}")
    if args.interval <= 0 or args.round_s <= 0 or args.duration <= 0:
        parser.error("--interval, --round-s and --duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    from coordinator.store import sqlite_url

    args = parse_args(argv)
    results = []
    backend = ""
    for peers in args.peers:
        with tempfile.TemporaryDirectory(prefix="coordinator-load-") as tmp:
            workdir = Path(tmp)
            os.chmod(workdir, 0o755)
            db_url = args.db or start_postgres(workdir) or sqlite_url(workdir / "state")
            backend = db_url.split(":", 1)[0]
            try:
                print(f"{peers} peers on {backend} ...", file=sys.stderr, flush=True)
                results.append(one_run(peers, args, db_url, workdir))
            finally:
                if not args.db and (workdir / "pg").exists():
                    subprocess.run(["bash", str(REPO / ".ci/postgres.sh"), "stop", str(workdir / "pg")], check=False)
    label = datetime.date.today().isoformat() + (f"-{args.label}" if args.label else "")
    command = " ".join(["python -m benchmarks.coordinator_load", *(argv if argv is not None else sys.argv[1:])])
    header = (
        f"Coordinator load, {label}, {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), `{command}`\n\n"
        f"Database {backend}; a heartbeat every {args.interval:g} s and a round report every {args.round_s:g} s per "
        f"peer (groups of {GROUP}), {args.duration:g} s measured after {args.interval:g} s of warm-up; the load "
        f"process and the coordinator share this machine's cores."
    )
    text = markdown(results, header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"coordinator-load-{label}.md").write_text(text)
    (args.out / f"coordinator-load-{label}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
