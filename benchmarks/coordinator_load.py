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
CHANNELS = 16
"""Connections the load process spreads its peers over (per port), and UDP sockets."""
DATAGRAM_TIMEOUT_S = 1.0
"""A heartbeat datagram unanswered this long goes over gRPC (``peer.link.datagram_beats``)."""
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


def children(pid: int) -> list[int]:
    """The heartbeat processes of the coordinator ``pid`` (its children that run ``coordinator.front``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"coordinator.front.process" in cmdline:
                found.append(int(entry))
    return found


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


def presigned(identity: Any, kind: str, body: Any, at: float, request_type: Any) -> tuple[bytes, bytes]:
    """A request signed now for sending at ``at`` (its timestamp), serialized, and its nonce."""
    from protocol.messages import sign_message

    signed = sign_message(identity, kind, body.SerializeToString(), now=at)
    return request_type(signed=signed.to_proto()).SerializeToString(), bytes(signed.nonce)


class DatagramAnswers(asyncio.DatagramProtocol):
    """Answers on one of the load process's UDP sockets, handed to the beat that waits for them."""

    def __init__(self) -> None:
        self.waiting: dict[bytes, asyncio.Future[None]] = {}

    def datagram_received(self, data: bytes, addr: Any) -> None:
        from protocol.errors import MalformedMessageError
        from protocol.heartbeat_datagram import parse_answer

        try:
            nonce, _ = parse_answer(data)
        except MalformedMessageError:
            return
        future = self.waiting.pop(nonce, None)
        if future is not None and not future.done():
            future.set_result(None)


async def run_load(address: str, digest: str, args: argparse.Namespace, peers: int, cpu: Any = dict) -> dict[str, Any]:
    """Join ``peers`` simulated peers, sign every heartbeat and report of the run ahead (so that
    the load process spends its core on sending, not on signatures), then send each at its time:
    a heartbeat every ``--interval`` s per peer, to the heartbeat port its join answer names;
    at each round's end every group's reports, spread over ``--report-spread-s``. ``cpu()``:
    CPU seconds so far by process role, read at the start and end of the measured window."""
    import grpc

    from protocol import coordinator_pb2 as pb
    from protocol import kinds
    from protocol.heartbeat_datagram import REQUEST_TAG
    from protocol.identity import Identity
    from protocol.messages import sign_message

    keys = [Identity.generate() for _ in range(peers)]
    host = address.rsplit(":", 1)[0]
    main = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    joined = 0
    heartbeat_port = 0

    def method(channel: Any, name: str, response: Any) -> Any:
        path = f"/swarmtrain.v1.Coordinator/{name}"
        return channel.unary_unary(path, request_serializer=None, response_deserializer=response.FromString)

    joins = [method(c, "Join", pb.JoinResponse) for c in main]

    async def join(index: int, identity: Identity) -> None:
        nonlocal joined, heartbeat_port
        body = pb.JoinBody(
            libp2p_peer_id=f"12D3Koo{identity.public_key.id[8:20]}", software_version="load", spec_digest=digest
        )
        envelope = sign_message(identity, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto()
        answer = await joins[index % CHANNELS](pb.JoinRequest(signed=envelope).SerializeToString(), timeout=120)
        heartbeat_port = answer.heartbeat_port
        joined += 1

    started = time.monotonic()
    for first in range(0, peers, 50):  # joins in batches: a public run's peers arrive over time
        await asyncio.gather(*(join(first + i, k) for i, k in enumerate(keys[first : first + 50])))
    join_s = time.monotonic() - started
    beats_address = f"{host}:{heartbeat_port}" if heartbeat_port else address
    beat_channels = [grpc.aio.insecure_channel(beats_address) for _ in range(CHANNELS)]
    heartbeat_calls = [method(c, "Heartbeat", pb.HeartbeatResponse) for c in beat_channels]
    # reports go where a peer sends them: the heartbeat port when it takes reports (an empty one
    # is refused there as malformed), else (a --ref whose heartbeat processes take none) the gRPC port
    # on connections of their own, as on the gRPC port: a report waits for its batch, and a
    # peer's own connection carries one at a time, never another peer's heartbeats behind it
    report_channels = [grpc.aio.insecure_channel(beats_address) for _ in range(CHANNELS)]
    report_calls = [method(c, "ReportRound", pb.RoundReportResponse) for c in report_channels]
    main_report_calls = [method(c, "ReportRound", pb.RoundReportResponse) for c in main]
    reports_to = [address]
    if heartbeat_port:
        try:
            await report_calls[0](b"", timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                reports_to = [beats_address]

    # heartbeats as datagrams where asked and the heartbeat port answers one (a --ref from
    # before them does not: its heartbeats go over gRPC)
    loop = asyncio.get_running_loop()
    datagrams: list[tuple[Any, DatagramAnswers]] = []
    if args.heartbeats == "udp" and heartbeat_port:
        datagrams = [
            await loop.create_datagram_endpoint(DatagramAnswers, remote_addr=(host, heartbeat_port))
            for _ in range(CHANNELS)
        ]
        probe, probe_nonce = presigned(
            keys[0], kinds.HEARTBEAT, pb.HeartbeatBody(phase=pb.PEER_PHASE_TRAINING), time.time(), pb.HeartbeatRequest
        )
        waiting: asyncio.Future[None] = loop.create_future()
        datagrams[0][1].waiting[probe_nonce] = waiting
        datagrams[0][0].sendto(REQUEST_TAG + probe)
        try:
            await asyncio.wait_for(waiting, timeout=3)
        except TimeoutError:
            print("coordinator_load: the heartbeat port answers no datagram: heartbeats over gRPC", file=sys.stderr)
            for sock, _ in datagrams:
                sock.close()
            datagrams = []

    # every request of the run, signed ahead at the time it will be sent
    warm_up = args.interval
    lead = 5.0 + peers * (args.duration + warm_up) / args.interval * 60e-6  # the signing itself
    wall_begin = time.time() + lead
    sends: list[
        tuple[float, int, bool, tuple[bytes, bytes], int]
    ] = []  # (offset, peer, is_report, (request, nonce), round)
    for index, identity in enumerate(keys):
        offset = args.interval * index / peers
        beat = 0
        while offset < warm_up + args.duration:
            body = pb.HeartbeatBody(
                round=beat, phase=pb.PEER_PHASE_TRAINING, samples_per_second=5.0, samples_total=beat * SAMPLES
            )
            sends.append(
                (
                    offset,
                    index,
                    False,
                    presigned(identity, kinds.HEARTBEAT, body, wall_begin + offset, pb.HeartbeatRequest),
                    0,
                )
            )
            offset += args.interval
            beat += 1
        first = index - index % GROUP
        group = [pb.GroupMember(public_key=m.public_key.raw, weight=SAMPLES) for m in keys[first : first + GROUP]]
        spread = args.report_spread_s * (index // GROUP) / max(1, peers // GROUP)  # a group reports together
        round_ = 1
        while round_ * args.round_s + spread < warm_up + args.duration:
            at = round_ * args.round_s + spread
            body = pb.RoundReportBody(
                round=round_,
                samples=SAMPLES,
                loss=2.0,
                group=group,
                state_digest=f"blake3:{round_:064x}",
                compute_s=args.round_s,
            )
            sends.append(
                (
                    at,
                    index,
                    True,
                    presigned(identity, kinds.ROUND_REPORT, body, wall_begin + at, pb.RoundReportRequest),
                    round_,
                )
            )
            round_ += 1
    sends.sort(key=lambda send: send[0])
    signing_s = time.time() - (wall_begin - lead)
    if time.time() > wall_begin:
        print(
            f"coordinator_load: signing took {signing_s:.0f} s, {time.time() - wall_begin:.0f} s more than planned",
            file=sys.stderr,
        )
    await asyncio.sleep(max(0.0, wall_begin - time.time()))

    latencies: list[tuple[float, float]] = []  # (when, seconds)
    report_latencies: list[float] = []
    errors: dict[str, int] = {}
    details: set[str] = set()  # what the first failures said
    reported: dict[int, int] = {}  # round -> reports sent
    begin = time.monotonic() - (time.time() - wall_begin)
    late: list[float] = []

    async def heartbeat(index: int, signed: tuple[bytes, bytes], when: float) -> None:
        request, nonce = signed
        sent = time.monotonic()
        late.append(sent - begin - when)
        if datagrams:  # as a peer sends it: a datagram, over gRPC when unanswered within a second
            sock, answers = datagrams[index % CHANNELS]
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            answers.waiting[nonce] = future
            sock.sendto(REQUEST_TAG + request)
            try:
                await asyncio.wait_for(future, timeout=DATAGRAM_TIMEOUT_S)
                latencies.append((when, time.monotonic() - sent))
                return
            except TimeoutError:
                answers.waiting.pop(nonce, None)
                errors["datagram unanswered"] = errors.get("datagram unanswered", 0) + 1
                # signed afresh, as a peer does: the datagram may have arrived late after all
                body = pb.HeartbeatBody(phase=pb.PEER_PHASE_TRAINING, samples_per_second=5.0)
                request, _ = presigned(keys[index], kinds.HEARTBEAT, body, time.time(), pb.HeartbeatRequest)
        try:
            answer = await heartbeat_calls[index % CHANNELS](request, timeout=30)
            latencies.append((when, time.monotonic() - sent))
            if not answer.admitted:
                errors["not admitted"] = errors.get("not admitted", 0) + 1
        except grpc.aio.AioRpcError as exc:
            errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            if len(details) < 5:
                details.add(f"heartbeat {exc.code().name}: {str(exc.details())[:160]}")

    async def report(index: int, signed: tuple[bytes, bytes], round_: int) -> None:
        sent = time.monotonic()
        try:
            calls = main_report_calls if reports_to[0] == address else report_calls
            await calls[index % CHANNELS](signed[0], timeout=60)
            report_latencies.append(time.monotonic() - sent)
            reported[round_] = reported.get(round_, 0) + 1
        except grpc.aio.AioRpcError as exc:
            errors["report " + exc.code().name] = errors.get("report " + exc.code().name, 0) + 1
            if len(details) < 5:
                details.add(f"report {exc.code().name}: {str(exc.details())[:160]}")

    load_cpu = time.process_time()
    cpu_begin, window_begin = cpu(), time.monotonic()
    tasks = set()
    for when, index, is_report, request, round_ in sends:
        delay = begin + when - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(report(index, request, round_) if is_report else heartbeat(index, request, when))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    try:
        status = await method(main[0], "GetStatus", pb.StatusResponse)(
            pb.StatusRequest().SerializeToString(), timeout=120
        )
        online = status.peers_online
    except grpc.aio.AioRpcError as exc:
        errors["status " + exc.code().name] = 1
        online = -1
    await asyncio.gather(*list(tasks))
    load_cpu = time.process_time() - load_cpu
    cpu_end, window = cpu(), time.monotonic() - window_begin
    for channel in (*main, *beat_channels, *report_channels):
        await channel.close()
    for sock, _ in datagrams:
        sock.close()
    measured = [s for when, s in latencies if when >= warm_up]
    halves = (
        [s for when, s in latencies if warm_up <= when < warm_up + args.duration / 2],
        [s for when, s in latencies if when >= warm_up + args.duration / 2],
    )
    return {
        "peers": peers,
        "joined": joined,
        "join_s": join_s,
        "signing_s": signing_s,
        "heartbeat_port": heartbeat_port,
        "heartbeats_over": "datagrams" if datagrams else "gRPC",
        "reports_to": "heartbeat port" if reports_to[0] != address else "gRPC port",
        "heartbeats": len(measured),
        "heartbeats_per_s": len(measured) / args.duration,
        "p50_ms": 1000 * percentile(measured, 0.5),
        "p99_ms": 1000 * percentile(measured, 0.99),
        "max_ms": 1000 * max(measured, default=float("nan")),
        "p99_first_half_ms": 1000 * percentile(halves[0], 0.99),
        "p99_second_half_ms": 1000 * percentile(halves[1], 0.99),
        "sent_late_p99_ms": 1000 * percentile(late, 0.99),
        "report_p50_ms": 1000 * percentile(report_latencies, 0.5),
        "report_p99_ms": 1000 * percentile(report_latencies, 0.99),
        "errors": errors,
        "error_details": sorted(details),
        "reported": reported,
        "peers_online": online,
        "load_cpu_share": load_cpu / window,
        "cpu_share": {role: (cpu_end.get(role, 0.0) - cpu_begin.get(role, 0.0)) / window for role in cpu_end},
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


def one_run(
    peers: int, args: argparse.Namespace, db_url: str, workdir: Path, tree: Path | None = None, processes: int = 1
) -> dict[str, Any]:
    """One load on a coordinator of this tree with ``processes`` heartbeat processes, or of the
    source tree ``tree`` (a ``--ref``)."""
    from coordinator.store import Store
    from protocol.spec import parse_spec
    from swarmtrain.localswarm import LocalCoordinator, wait_until

    spec_path = workdir / "spec.toml"
    spec_path.write_text(SPEC)
    digest = parse_spec(SPEC).digest()
    # every simulated peer sends from 127.0.0.1: no per-source request limit
    extra = ["--archive-every", "0", "--max-requests-per-source", "0"]
    executable = None
    if tree is None:
        extra += ["--heartbeat-processes", str(processes)]
    else:  # the ref's code first on the path (the venv's editable install points at this tree)
        path = [str(tree), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_repo(p))]
        # -P: not the working directory's code; run in the ref's tree, so that the heartbeat
        # processes it starts (a child without -P has its working directory on its path) are the ref's too
        executable = [
            "env",
            "-C",
            str(tree),
            f"PYTHONPATH={os.pathsep.join(path)}",
            sys.executable,
            "-P",
            "-m",
            "swarmtrain",
        ]
    if args.nice:  # the coordinator (and its heartbeat processes) yield the cores to the load process
        from swarmtrain.localswarm import swarmtrain_executable

        executable = ["nice", "-n", str(args.nice), *(executable or swarmtrain_executable())]
    coordinator = LocalCoordinator(
        spec_path, workdir / "state", db_url=db_url, extra=extra, host="127.0.0.1", executable=executable
    )
    try:
        address = coordinator.address()
        rows_before = count_rows(db_url)
        wall_before = time.monotonic()
        pid = coordinator.proc.pid

        def cpu() -> dict[str, float]:
            return {"coordinator": cpu_seconds(pid), "heartbeats": sum(cpu_seconds(c) for c in children(pid))}

        result = asyncio.run(run_load(address, digest, args, peers, cpu))
        wall = time.monotonic() - wall_before
        store = Store(db_url)
        try:
            try:
                wait_until(lambda: not store.pending_claims(), args.settle_s, "every claim decided")
            except TimeoutError:
                print(f"coordinator_load: claims still pending {args.settle_s:g} s after the window", file=sys.stderr)
            pending = len(store.pending_claims())
            rows_after = count_rows(db_url)
            keys = set(result.pop("keys"))
            claims = [c for c in store.claims(limit=10**7) if c.key in keys]
        finally:
            store.close()
        result["rows_per_hour"] = {t: (rows_after[t] - rows_before[t]) * 3600 / wall for t in rows_after}
        result["claims"] = len(claims)
        result["claims_pending_after_settle"] = pending
        log = (workdir / "state" / "coordinator.log").read_text(errors="replace").splitlines()
        result["coordinator_log_problems"] = [line[:200] for line in log if " ERROR " in line or "Traceback" in line][
            :5
        ]
        result["code"] = args.ref if tree is not None else "this tree"
        result["heartbeat_processes"] = 0 if tree is not None else processes
        result["claims_granted_in_full"] = sum(
            1 for c in claims if c.status == "granted" and c.granted_samples == SAMPLES
        )
        result["claims_not_granted"] = [(c.round, c.status, c.reason[:120]) for c in claims if c.status != "granted"][
            :5
        ]
        return result
    finally:
        coordinator.stop()


def _is_repo(path: str) -> bool:
    try:
        return Path(path).resolve() == REPO
    except OSError:
        return False


def _code(r: dict[str, Any]) -> str:
    """A result's code and heartbeat processes, as its row names them."""
    code = r.get("code", "this tree")
    processes = r.get("heartbeat_processes")
    named = f"{code}, {processes} heartbeat process(es)" if processes else code
    return f"{named}, heartbeats over {r['heartbeats_over']}" if "heartbeats_over" in r else named


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| code | peers | heartbeats/s | p50 ms | p99 ms | max ms | p99 1st / 2nd half ms | reports p50 / p99 ms "
        "| coordinator CPU | heartbeat processes' CPU | load CPU | sent late p99 ms | claims granted in full "
        "| errors | online |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = r["cpu_share"]
        lines.append(
            f"| {_code(r)} | {r['peers']} | {r['heartbeats_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.0f} "
            f"| {r['p99_first_half_ms']:.1f} / {r['p99_second_half_ms']:.1f} "
            f"| {r['report_p50_ms']:.0f} / {r['report_p99_ms']:.0f} "
            f"| {100 * share['coordinator']:.0f}% | {100 * share['heartbeats']:.0f}% "
            f"| {100 * r['load_cpu_share']:.0f}% | {r['sent_late_p99_ms']:.0f} "
            f"| {r['claims_granted_in_full']} of {r['claims']} | {sum(r['errors'].values())} "
            f"| {r['peers_online']} |"
        )
    lines += ["", "CPU as a share of one core over the measured window. Database rows written per hour:", ""]
    for r in results:
        rows = ", ".join(f"{t} {v:,.0f}" for t, v in r["rows_per_hour"].items())
        lines.append(f"- {_code(r)}, {r['peers']} peers: {rows}")
    errors = [
        f"- {_code(r)}, {r['peers']} peers: {r['errors']}"
        + "".join(f"\n  - {detail}" for detail in r.get("error_details", []))
        for r in results
        if r["errors"]
    ]
    if errors:
        lines += ["", "Errors:", "", *errors]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordinator_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[500, 2000], help="simulated peers; one run each")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a peer's heartbeats")
    parser.add_argument("--round-s", type=float, default=30.0, help="seconds between a peer's round reports")
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds per run")
    parser.add_argument(
        "--report-spread-s",
        type=float,
        default=5.0,
        help="a round's reports arrive within this many seconds of its end (the burst; default 5)",
    )
    parser.add_argument(
        "--heartbeat-processes",
        type=int,
        nargs="+",
        default=[1],
        help="the coordinator's --heartbeat-processes; one run each (default 1)",
    )
    parser.add_argument(
        "--heartbeats",
        choices=("udp", "grpc"),
        default="udp",
        help="how the simulated peers send heartbeats: as datagrams, over gRPC when unanswered within a "
        "second, as a peer does (default; a --ref that answers none gets them over gRPC), or over gRPC only",
    )
    parser.add_argument(
        "--ref", default="", help="also load a coordinator of this git ref, in the same run (the baseline)"
    )
    parser.add_argument(
        "--ref-tree",
        type=Path,
        default=None,
        help="the --ref's source, already extracted (`git archive REF | tar -x -C DIR`; where there is no git)",
    )
    parser.add_argument(
        "--settle-s", type=float, default=180.0, help="how long to wait after a run for every claim decided"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the coordinator at this niceness, so that on a machine of few cores the load process (a "
        "stand-in for thousands of machines) is not starved by what it measures (0: as the load process)",
    )
    parser.add_argument(
        "--db", default="", help="database URL, or 'sqlite' (default: a throwaway PostgreSQL, else SQLite)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if args.ref_tree is not None and not (args.ref and (args.ref_tree / "swarmtrain").is_dir()):
        parser.error("--ref-tree needs --ref (its name) and a directory holding that ref's source")
    if min(args.heartbeat_processes) < 1:
        parser.error("--heartbeat-processes must be at least 1")
    if not all(p >= GROUP and p % GROUP == 0 for p in args.peers):
        parser.error(f"--peers must be multiples of {GROUP}")
    if args.interval <= 0 or args.round_s <= 0 or args.duration <= 0:
        parser.error("--interval, --round-s and --duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    from coordinator.store import sqlite_url

    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    backend = ""
    label = datetime.date.today().isoformat() + (f"-{args.label}" if args.label else "")
    command = " ".join(["python -m benchmarks.coordinator_load", *(argv if argv is not None else sys.argv[1:])])
    text = ""
    trees: list[Path | None] = [None]
    worktree: Path | None = None
    if args.ref_tree is not None:
        trees.append(args.ref_tree.resolve())
    elif args.ref:
        worktree = Path(tempfile.mkdtemp(prefix="coordinator-load-ref-"))
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-f", "--detach", str(worktree), args.ref], check=True
        )
        trees.append(worktree)
    runs = [
        (peers, tree, processes)
        for peers in args.peers
        for tree in trees
        for processes in (args.heartbeat_processes if tree is None else [1])
    ]
    for peers, tree, processes in runs:
        with tempfile.TemporaryDirectory(prefix="coordinator-load-") as tmp:
            workdir = Path(tmp)
            os.chmod(workdir, 0o755)
            if args.db == "sqlite":
                db_url = sqlite_url(workdir / "state")
            else:
                db_url = args.db or start_postgres(workdir) or sqlite_url(workdir / "state")
            backend = db_url.split(":", 1)[0]
            try:
                code = f"this tree, {processes} heartbeat process(es)" if tree is None else args.ref
                print(f"{peers} peers on {backend}, {code} ...", file=sys.stderr, flush=True)
                results.append(one_run(peers, args, db_url, workdir, tree, processes))
            finally:
                if args.db in ("", "sqlite") and (workdir / "pg").exists():
                    subprocess.run(["bash", str(REPO / ".ci/postgres.sh"), "stop", str(workdir / "pg")], check=False)
        header = (
            f"Coordinator load, {label}, {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), `{command}`\n\n"
            f"Database {backend}; a heartbeat every "
            f"{args.interval:g} s per peer; every {args.round_s:g} s a round ends and every peer reports it (groups "
            f"of {GROUP}), the reports arriving within {args.report_spread_s:g} s; {args.duration:g} s measured after "
            f"{args.interval:g} s of warm-up. Every request is signed before the measured window; the load process, "
            f"the coordinator and its database share this machine's cores."
        )
        text = markdown(results, header)  # written after each run: a later one that fails loses nothing
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"coordinator-load-{label}.md").write_text(text)
        (args.out / f"coordinator-load-{label}.json").write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2, default=str)
        )
    if worktree is not None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
