"""Round formation and averaging at the size of a public run (issue #25): ``make bench-rounds``.

For each swarm size N, N members average round after round; reported per N: the time to
form the round, the fraction of rounds that landed exactly one state, the peers averaged,
bytes per member, the all-reduce time, memory per member, and how each grows with N.

What is real: every member is a swarm member as a peer runs it (``peer.swarm.swarm.Swarm``): its
own hivemind DHT node and p2pd daemon, the ``ExactAverager`` (in its own process) with the
round's matchmaking (``engine.matchmaking``: one group of any size, the per-round group
key, the leader closing once the roster is complete), the exact butterfly all-reduce over
libp2p on loopback, signed digest records in the DHT, state download to re-sync. Each
member gathers what a trainer gathers (id, round, samples, pre-round digest, roster) and
judges its group by the roster rule (``protocol.roster.verdict``) before landing, as the
trainer does; a member that misses the round's group re-syncs by downloading the landed
state (verified by its digest) and is in the next round.

What is not: there is no model and no training: a member's pseudo-gradient is a seeded
random vector of ``--values`` floats, and the inner phase is a random launch offset in
``[0, --spread)`` s; the members' handles live in one driver process (their DHT nodes,
averagers and p2pd daemons are separate processes, as in a peer), all on this machine's
cores, on loopback (no latency or bandwidth limit); a member re-syncs to the digest the
other members landed (the driver's view) instead of looking the agreed state up in the DHT.

Formation time is from the last member's launch to the group's all-reduce start (what
matchmaking adds once everyone is looking); the first round is reported apart: with no
roster yet its leader waits out its window by design (docs/design/round.md, "The round at any size"). All members
share this machine's cores, so formation time here grows with the whole swarm's work; the
leader's own part of it is measured apart: the CPU its averager's event loop spends from its
search's start to assembling the group (``RoundMatchmaking.led``: the join requests, the roster
rule, serialising the group), and the metadata bytes it sends to start the round (every
follower receives every member's gathered metadata).

Writes ``benchmarks/results/round-formation.{md,json}``. Usage:
``python -m benchmarks.round_formation [--sizes 16,64,128] [--rounds 8] [--values 65536] [--timeout 60]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.scale import process_tree, pss_bytes
from engine.allreduce import part_size_bytes
from engine.codecs import get_codec
from engine.fragments import fragment_bounds
from engine.start_tree import plan_start
from peer.round.roster_book import RosterBook
from peer.round.swarm_port import RoundResult
from peer.swarm.swarm import PendingRound, Swarm
from protocol.gathered import Gathered
from protocol.identity import Identity
from protocol.roster import verdict
from protocol.spec import RunSpec, parse_spec
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SPEC = """
[run]
name = "round-formation"
[task.model]
d_model = 32
n_layers = 1
n_heads = 2
context = 16
[averaging]
compression = "{codec}"
overlap = false
min_group_size = 2
matchmaking_timeout_s = {timeout}
allreduce_timeout_s = {allreduce_timeout}
{extra}"""


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) spent so far by the process ``pid`` (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) spent so far by ``root`` and its descendants."""
    return sum(_process_cpu(pid) for pid in process_tree(root))


def cpu_by_part(members: list[Member]) -> dict[str, float]:
    """CPU seconds spent so far by the members' DHT node processes, averager processes and p2pd
    daemons, each summed over the members (what a member's machine would spend, times N)."""
    p2pd = 0.0
    for pid in process_tree(os.getpid(), include_root=False):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
                p2pd += _process_cpu(pid)
        except OSError:
            continue
    return {
        "dht": sum(_process_cpu(m.swarm.dht.pid) for m in members if m.swarm.dht.pid is not None),
        "averager": sum(_process_cpu(m.swarm.averager.pid) for m in members if m.swarm.averager.pid is not None),
        "p2pd": p2pd,
    }


@dataclass
class Member:
    """One member's swarm and the state it holds."""

    index: int
    swarm: Swarm
    identity: Identity
    params: torch.Tensor
    momentum: torch.Tensor
    round: int = 0
    digest: str = ""
    roster: RosterBook = field(default_factory=RosterBook)
    pending: PendingRound | None = None
    launched: float = 0.0

    def __post_init__(self) -> None:
        self.digest = state_digest(self.round, self.params, self.momentum)
        self.swarm.serve_state(lambda take: take(self.round, self.params, self.momentum, self.digest))

    def launch(self, common: torch.Tensor, rng: torch.Generator) -> None:
        """Write this round's pseudo-gradient: the swarm's common direction plus this member's
        own noise (as members' pseudo-gradients agree in part: robust averaging keeps them)."""
        with self.swarm.outbox() as out:
            torch.randn(out.shape, generator=rng, out=out).mul_(0.5e-3).add_(common)
        gather = Gathered(
            id=self.identity.public_key.id,
            round=self.round,
            digest=self.digest,
            samples=1,
            roster=self.roster.size,
            known=self.roster.known,
        )
        self.pending = self.swarm.start_round(weight=1.0, gather=gather)
        self.launched = time.monotonic()

    def land(self, result: RoundResult) -> None:
        """The trainer's landing, minus the model: θ ← θ − Δ̄ (outer SGD, lr 1), next round."""
        if result.started_in_sync(self.round, self.digest):
            self.roster.landed(result.members)
        self.swarm.saw_group(result.members)
        self.params.sub_(result.averaged)
        self.round += 1
        self.digest = state_digest(self.round, self.params, self.momentum)
        self.swarm.publish_digest(self.identity, round_=self.round, digest=self.digest, roster=self.roster.size)

    def resync(self, digest: str, timeout: float) -> bool:
        state = self.swarm.download_state({digest}, timeout=timeout)
        if state is None:
            return False
        self.round, params, momentum = state
        self.params.copy_(params)
        self.momentum.copy_(momentum)
        self.digest = digest
        claim = self.swarm.roster_of(digest, exclude=self.identity.public_key)
        self.roster.adopted(claim, round_=self.round, me=self.identity.public_key.id)
        return True


def start_members(n: int, spec: RunSpec, values: int) -> list[Member]:
    codec = get_codec(spec.averaging.compression)
    members: list[Member] = []
    bootstrap: list[str] = []
    for i in range(n):
        swarm = Swarm(spec, values, codec, initial_peers=bootstrap, host_maddrs=LOOPBACK)
        if i < 3:  # a few bootstrap nodes, as a run's coordinator and first peers would be
            bootstrap = bootstrap + swarm.visible_maddrs
        members.append(Member(i, swarm, Identity.generate(), torch.zeros(values), torch.zeros(values)))
    return members


def spread(args: argparse.Namespace, n: int) -> float:
    """Seconds over which the N members launch: ``--spread``, or ``--spread-per-member`` × N if
    longer (members on machines of their own finish their inner phases at different times; a
    spread that grows with N keeps this machine's two cores from queueing all N members' work
    at once, so formation time is the round's own path, not the wait for a core)."""
    return max(args.spread, args.spread_per_member * n)


def one_round(members: list[Member], r: int, args: argparse.Namespace) -> dict[str, Any]:
    """Launch every member within ``spread(args, N)`` s, wait for the results, land or re-sync."""
    rng = random.Random(r)
    cpu_before, parts_before = cpu_seconds(os.getpid()), cpu_by_part(members)
    offsets = sorted((rng.uniform(0, spread(args, len(members))), m.index) for m in members)
    base = time.monotonic() + 0.2
    common = torch.randn(args.values, generator=torch.Generator().manual_seed(r)).mul_(1e-3)
    for offset, index in offsets:
        time.sleep(max(0.0, base + offset - time.monotonic()))
        members[index].launch(common, torch.Generator().manual_seed(r * 100_003 + index + 1))
    results: list[RoundResult | None] = []
    for m in members:
        assert m.pending is not None
        results.append(m.pending.result())
    groups: set[frozenset[str]] = set()
    landed: list[tuple[Member, RoundResult, float]] = []
    for m, result in zip(members, results):
        if result is None:
            continue
        groups.add(frozenset(d.id for d in result.members))
        found = verdict(result.members, min_group_size=2)
        if result.stats.missing and found.lands:  # as the trainer: the others land it without m
            m.roster.missed(m.round, result.members, m.digest)
            m.swarm.saw_group(result.members)
            continue
        if not found.lands:
            m.roster.refused(found, m.digest)
            continue
        started = m.launched + result.matchmaking_s
        m.land(result)
        landed.append((m, result, started))
    states = {m.digest for m, _, _ in landed}
    done = {m.index for m, _, _ in landed}
    missed = [m for m in members if m.index not in done]
    if landed:
        majority = statistics.mode([m.digest for m, _, _ in landed])
        for m in missed:
            if not m.resync(majority, timeout=args.timeout):
                logger.warning("member %d could not re-sync after round %d", m.index, r)
    cpu_per_member = (cpu_seconds(os.getpid()) - cpu_before) / len(members)
    parts = {k: round((v - parts_before[k]) / len(members), 4) for k, v in cpu_by_part(members).items()}
    last_launch = max(m.launched for m in members)
    first_launch = min(m.launched for m in members)
    allreduce_start = statistics.median(s for _, _, s in landed) if landed else float("nan")
    leaders = [x.led for _, x, _ in landed if x.led is not None]
    return {
        "round": r,
        "groups": len(groups),
        "states": len(states),
        "averaged": len(landed),
        "formation_s": round(allreduce_start - last_launch, 3),
        "first_launch_to_allreduce_s": round(allreduce_start - first_launch, 3),
        "cpu_s_per_member": round(cpu_per_member, 3),
        "cpu_s_per_member_by_part": parts,
        "leader_loop_cpu_s": round(max(x["loop_cpu_s"] for x in leaders), 4) if leaders else None,
        "leader_begin_bytes": int(max(x["begin_bytes"] for x in leaders)) if leaders else None,
        # hivemind's leader sent the whole group to every follower: (N - 1) whole messages
        "leader_begin_bytes_n2": int(max((len(members) - 1) * x["whole_bytes"] for x in leaders)) if leaders else None,
        "start_bytes_max": max(x.stats.start_bytes for _, x, _ in landed) if landed else None,
        "pss_mb_per_member": round(pss_bytes(os.getpid(), include_root=False) / len(members) / 2**20, 1),
        "allreduce_s": round(statistics.median(x.stats.allreduce_s for _, x, _ in landed), 3) if landed else None,
        # the all-reduce's time holds the member's audit of one reducer (``averaging.audit``, on)
        "audit_s": round(statistics.median(x.stats.audit_s for _, x, _ in landed), 3) if landed else None,
        "bytes_per_member": int(statistics.mean(x.stats.bytes_sent + x.stats.bytes_received for _, x, _ in landed))
        if landed
        else 0,
    }


def reducers(values: int, streams: int, codec: str, members: int) -> int:
    """How many of ``members`` reduce a part of every fragment of a vector of ``values`` cut into
    ``streams`` fragments: hivemind cuts each fragment into parts of ``part_size_bytes`` and gives
    each part to one member, so a fragment of fewer parts than members leaves the rest sending only
    (before 2d7fb30, this benchmark's 65,536 values were two parts: 2 reducers in 128)."""
    wire = get_codec(codec)
    per_value = wire.bytes_per_value()
    fewest = members
    for start, end in fragment_bounds(values, streams):
        part_values = max(1, int(part_size_bytes(end - start, wire, members) / per_value))
        fewest = min(fewest, -(-(end - start) // part_values))
    return fewest


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    extra = "".join(
        f"{key} = {value}\n" for key, value in (("streams", args.streams), ("audit", args.audit)) if value is not None
    )
    spec = parse_spec(
        SPEC.format(codec=args.codec, timeout=args.timeout, allreduce_timeout=max(30.0, args.timeout), extra=extra)
    )
    started = time.monotonic()
    members = start_members(n, spec, args.values)
    startup_s = time.monotonic() - started
    memory = pss_bytes(os.getpid(), include_root=False)  # the members' processes, not the driver
    try:
        rounds = []
        for r in range(args.rounds + 1):  # each round's line as it lands: a run cut short keeps them
            rounds.append(one_round(members, r, args))
            print(json.dumps({"members": n, **rounds[-1]}), file=sys.stderr, flush=True)
    finally:
        for m in members:
            m.swarm.shutdown()
    first, steady = rounds[0], rounds[1:]
    one_state = sum(1 for x in steady if x["states"] == 1 and x["averaged"] > 0)
    formation = [x["formation_s"] for x in steady if not math.isnan(x["formation_s"])]
    row = {
        "members": n,
        "reducers": reducers(args.values, spec.averaging.streams, args.codec, n),
        "rounds": len(steady),
        "one_state_fraction": round(one_state / len(steady), 3),
        "peer_rounds_averaged": round(sum(x["averaged"] for x in steady) / (n * len(steady)), 3),
        "formation_s_median": round(statistics.median(formation), 3) if formation else None,
        "formation_s_max": round(max(formation), 3) if formation else None,
        "allreduce_s_median": statistics.median(x["allreduce_s"] for x in steady if x["allreduce_s"] is not None),
        "audit_s_median": _median(x.get("audit_s") for x in steady),
        "bytes_per_member": int(statistics.mean(x["bytes_per_member"] for x in steady)),
        "cpu_s_per_member_round": round(statistics.median(x["cpu_s_per_member"] for x in steady), 3),
        **{
            f"{part}_cpu_s_per_member_round": _median(x["cpu_s_per_member_by_part"][part] for x in steady)
            for part in ("dht", "p2pd", "averager")
        },
        "leader_cpu_ms_per_member": round(1000 * leader / n, 2)
        if (leader := _median(x.get("leader_loop_cpu_s") for x in steady)) is not None
        else None,
        "leader_loop_cpu_s": _median(x.get("leader_loop_cpu_s") for x in steady),
        "leader_begin_bytes": _median(x.get("leader_begin_bytes") for x in steady),
        "leader_begin_bytes_n2": _median(x.get("leader_begin_bytes_n2") for x in steady),
        "start_bytes_max": _median(x.get("start_bytes_max") for x in steady),
        "first_round_formation_s": first["formation_s"],
        "startup_s": round(startup_s, 1),
        "pss_per_member_mb": round(memory / n / 2**20, 1),
        "per_round": rounds,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "per_round"}), flush=True)
    return row


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None if none are)."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each size's formation time and bytes against the smallest size's, beside N's and log N's ratios."""
    base = rows[0]
    out = []
    for row in rows:
        ratio_n = row["members"] / base["members"]
        out.append(
            {
                "members": row["members"],
                "n_ratio": round(ratio_n, 2),
                "log_n_ratio": round(math.log2(row["members"]) / math.log2(base["members"]), 2),
                "formation_ratio": round(row["formation_s_median"] / base["formation_s_median"], 2)
                if row["formation_s_median"] and base["formation_s_median"]
                else None,
                "bytes_ratio": round(row["bytes_per_member"] / base["bytes_per_member"], 3)
                if base["bytes_per_member"]
                else None,
                "cpu_ratio": round(row["cpu_s_per_member_round"] / base["cpu_s_per_member_round"], 2)
                if row.get("cpu_s_per_member_round") and base.get("cpu_s_per_member_round")
                else None,
                "leader_cpu_ratio": round(row["leader_loop_cpu_s"] / base["leader_loop_cpu_s"], 2)
                if row.get("leader_loop_cpu_s") and base.get("leader_loop_cpu_s")
                else None,
            }
        )
    return out


GATHERED_BYTES = 175
"""What one member gathers here (``Member.launch``: id, round, digest, samples, roster), in bytes."""
PLAN_SIZES = (16, 64, 128, 256, 1024, 4096)
"""Group sizes whose start bytes ``start_plan_bytes`` computes."""


def start_plan_bytes(gathered_bytes: int, sizes: Iterable[int] = PLAN_SIZES) -> list[dict[str, int]]:
    """For each group size: the bytes the leader sends to start the group and the most any other
    member sends (a parent serving its children), by the plan the leader runs
    (``engine.start_tree.plan_start``, every member dialable), beside hivemind's leader, which
    sent the whole group to every follower. ``gathered_bytes``: one member's gathered metadata,
    as measured."""
    out = []
    for n in sizes:
        peers = [b"\x00\x24" + index.to_bytes(36, "big") for index in range(n)]
        gathered = [b"\x93" + bytes(max(0, gathered_bytes - 1))] * n
        plan = plan_start(b"g" * 20, peers[0], peers, gathered, lambda _: True)
        children: dict[bytes, int] = {}
        for parent in plan.parents.values():
            children[parent] = children.get(parent, 0) + 1
        out.append(
            {
                "members": n,
                "whole_bytes": plan.whole_bytes,
                "leader_bytes": plan.leader_bytes(n - 1),
                "parent_bytes_max": max(children.values(), default=0) * plan.whole_bytes,
                "hivemind_leader_bytes": (n - 1) * plan.whole_bytes,
            }
        )
    return out


def plan_lines(plan: list[dict[str, int]]) -> list[str]:
    return [
        f"The start's bytes by the leader's plan (`engine.start_tree.plan_start`, computed; {GATHERED_BYTES} "
        "bytes of gathered metadata a member, as here) against hivemind's leader, which sent the whole "
        "group to every follower:",
        "",
        "| members | one whole start, bytes | leader sends | most a parent sends | hivemind's leader sent |",
        "|---|---|---|---|---|",
        *(
            f"| {p['members']} | {p['whole_bytes']:,} | {p['leader_bytes']:,} | {p['parent_bytes_max']:,} "
            f"| {p['hivemind_leader_bytes']:,} |"
            for p in plan
        ),
    ]


def write_plan(args: argparse.Namespace, command: str) -> None:
    """``--plan-only``: the plan's table alone, in ``<name>.{md,json}``."""
    RESULTS.mkdir(exist_ok=True)
    plan = start_plan_bytes(GATHERED_BYTES)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"command": command, "start_plan": plan}, indent=1) + "\n")
    lines = ["# A round's start: bytes by the leader's plan", "", f"Command: `{command}`.", "", *plan_lines(plan)]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")


def write(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    grown = growth(rows)
    plan = start_plan_bytes(GATHERED_BYTES)
    data = {
        "command": command,
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}",
        "args": vars(args),
        "sizes": rows,
        "growth": grown,
        "start_plan": plan,
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(data, indent=1) + "\n")
    cols = [
        "members",
        "reducers",
        "rounds",
        "one_state_fraction",
        "peer_rounds_averaged",
        "formation_s_median",
        "formation_s_max",
        "allreduce_s_median",
        "audit_s_median",
        "bytes_per_member",
        "cpu_s_per_member_round",
        "dht_cpu_s_per_member_round",
        "p2pd_cpu_s_per_member_round",
        "averager_cpu_s_per_member_round",
        "leader_loop_cpu_s",
        "leader_cpu_ms_per_member",
        "leader_begin_bytes",
        "leader_begin_bytes_n2",
        "start_bytes_max",
        "first_round_formation_s",
        "pss_per_member_mb",
    ]
    lines = [
        "# Round formation and averaging against the swarm's size",
        "",
        f"Command: `{command}` ({data['machine']}; {args.values:,} values per member, "
        f"codec {args.codec}, streams {args.streams or 'as the spec (4)'}, audits "
        f"{args.audit or 'as the spec (on)'}, launches spread over {spread_text(args)}, "
        f"matchmaking timeout {args.timeout} s).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(row[c]) for c in cols) + " |" for row in rows),
        "",
        "Growth against the smallest size:",
        "",
        "| members | N ratio | log N ratio | formation ratio | bytes ratio | CPU per member ratio "
        "| leader's loop CPU ratio |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {g['members']} | {g['n_ratio']} | {g['log_n_ratio']} | {g['formation_ratio']} | {g['bytes_ratio']} "
            f"| {g['cpu_ratio']} | {g['leader_cpu_ratio']} |"
            for g in grown
        ),
        "",
        *plan_lines(plan),
        "",
        "Per round (groups, distinct states, members averaged, formation s):",
        "",
        *(
            f"- N={row['members']}: "
            + ", ".join(
                f"r{x['round']}: {x['groups']}g/{x['states']}s/{x['averaged']}a/{x['formation_s']}s"
                for x in row["per_round"]
            )
            for row in rows
        ),
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")


def spread_text(args: argparse.Namespace) -> str:
    if args.spread_per_member > 0:
        return f"max({args.spread} s, {args.spread_per_member} s × N)"
    return f"{args.spread} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64,128", help="comma-separated swarm sizes")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per size after the first")
    parser.add_argument("--values", type=int, default=65_536, help="floats each member averages")
    parser.add_argument("--codec", default="fp16")
    parser.add_argument("--streams", type=int, default=None, help="fragments averaged at once (default: the spec's, 4)")
    parser.add_argument(
        "--audit",
        choices=("true", "false"),
        default=None,
        help="each member audits one reducer a round (default: the spec's, on); on 2 cores at 128 members "
        "the shipped 4 fragments and audits do not finish an all-reduce within the timeout",
    )
    parser.add_argument("--spread", type=float, default=1.0, help="members launch within this many s")
    parser.add_argument(
        "--spread-per-member", type=float, default=0.0, help="members launch within at least this many s × N"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="matchmaking timeout (s)")
    parser.add_argument("--name", default="round-formation", help="results file name")
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="start no member: write the start's bytes by the leader's plan at 16 to 4,096 members",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if (
        any(n < 2 for n in sizes)
        or args.rounds < 1
        or args.values < 1
        or min(args.spread, args.spread_per_member) < 0
        or args.timeout <= 0
    ):
        parser.error("sizes ≥ 2, rounds ≥ 1, values ≥ 1, spreads ≥ 0 and timeout > 0 are required")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    command = "python -m benchmarks.round_formation " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.plan_only:
        write_plan(args, command)
        return 0
    rows: list[dict[str, Any]] = []
    for n in sizes:  # written after each size: a run cut short keeps what it measured
        rows.append(run_size(n, args))
        write(rows, args, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
