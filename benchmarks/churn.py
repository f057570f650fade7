"""A public run's lab: volunteers at home, on rented GPUs and in datacenters come and go, and the
swarm should not wait for them.

    make bench-churn CHURN_ARGS="[--peers 12] [--churning 4] [--window-s 240] [--lifetime-s 30]
                                 [--downtime-s 15] [--coordinator-restarts 1] [--phase-s 8] [--seed 0]"   (as root)

A coordinator and ``--peers`` peers train the demo's model (rounds of an 8 s inner phase) in
network namespaces placed as a public run's volunteers are (``benchmarks.topologies``): in turn
a datacenter (a public address, 1 Gbit/s, 2.5 ms one way), a rented GPU behind a provider's port
mapping (``--announce``, 1 Gbit/s, 10 ms) and two homes behind their own NAT routers (50 Mbit/s,
20 ms; reached through relays or punched holes), so RTTs run from 10 to 80 ms over links 20x
apart. The last ``--churning`` peers come and go as volunteers do, each on its own Poisson clock:
up for an exponentially distributed time of mean ``--lifetime-s`` (a few rounds), then gone
(a clean stop, SIGINT: it says so in a signed record, or killed with its children, SIGKILL: a
lost machine, one or the other at random) for one of mean ``--downtime-s``, then back with its
key (a join: state download, roll forward, first round). ``--coordinator-restarts`` times in the
window the coordinator is SIGKILLed and started again 20 s later on its state. Once the swarm
has landed 3 rounds, a window of ``--window-s`` is measured; the churn-free run is the same
swarm with no event.

Figures, from the peers' own metrics rows (``at``: when a row was recorded) and the
coordinator's API, over the window:

- **goodput**, as the issue defines it: samples that landed in the swarm's state (rows averaged
  in sync in a group of two or more, with the samples of the rounds before them that failed here
  and whose work they carried, ``carried``) over samples computed (every row's, plus the inner steps a
  killed peer took since its last row, estimated from its speed). The issue's figure is the
  churning run's goodput against the churn-free run's.
- **time goodput**, a stricter figure: the share of the peers' time online spent on inner steps
  whose round landed: each such row's ``compute_s`` over the seconds the peers' processes ran in
  the window (to its exit: a clean stop finishes its round). Starting a process, waiting for a
  round, downloading and rolling a state forward, rounds that failed, and a killed peer's last
  steps all count against it.
- **samples**: trained (every row) and averaged into the state (contributing rows).
- **swarm rate**: samples averaged into the swarm's state per second (falls with the peers gone).
- **rounds with two states**: rounds whose in-sync rows name more than one state digest.
- **stuck**: the most rounds the swarm landed between a peer's (re)start and its first
  contribution, and the longest run of a peer's consecutive rows that did not contribute.
- **credit lost**: for each round the coordinator finalized, the samples the peers' rows say they
  contributed less those the coordinator credited (``/api/v1/rounds``), summed where positive.

Writes ``churn-lab-<date>.md``/``.json`` under ``--out`` (default ``benchmarks/results``). Needs root
(namespaces); says so and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lab_coordinator import LabCoordinator
from benchmarks.netsim import NotRootError, WanSim
from benchmarks.slow_join import ONE_THREAD, SPEC, SW, contributed, metrics_rows
from benchmarks.topologies import PEER_PORT, PLACES, public_run

OUTAGE_S = 20.0
"""How long the coordinator stays down at each restart."""
STARTUP_S = 4.0
"""About how long a peer takes from its start to its first inner step here (imports, the
coordinator, the DHT, the state download): only used to estimate the work a peer killed before
its first row lost."""
LEAVE_WAIT_S = 60.0
"""How long a clean stop may take (the peer finishes its round first) before it is killed."""


@dataclass
class ChurnFigures:
    churn: bool
    window_s: float
    events: list[str] = field(default_factory=list)
    """What happened, in order: ``"+p9"`` a start, ``"-p10 clean"``/``"-p11 kill"`` a stop,
    ``"-coordinator kill"``/``"+coordinator"``."""
    places: dict[str, str] = field(default_factory=dict)
    """Each peer's place (``benchmarks.topologies``)."""
    churners: list[str] = field(default_factory=list)
    """The peers that came and went."""
    trained: int = 0
    counted: int = 0
    online_s: float = 0.0
    """Seconds the peers' processes ran within the window, summed."""
    useful_s: float = 0.0
    """Seconds of inner steps of contributing rows within the window, summed."""
    rounds: int = 0
    """Rounds the swarm landed in the window."""
    two_states: int = 0
    stuck_start_rounds: int = 0
    stuck_rows: int = 0
    credit_lost: int = 0
    credited_rounds: int = 0
    lost: int = 0
    """Samples computed and never reported: the inner steps a killed peer took since its last row
    (estimated: its samples per second of compute, from its rows or the swarm's, times the time
    it trained since then)."""
    lives: list[dict[str, Any]] = field(default_factory=list)
    """Each run of a peer within the window: its slot, seconds online, seconds of contributing inner
    steps, and seconds from its start to its first row and to its first contribution (None: none)."""

    @property
    def goodput(self) -> float:
        return self.useful_s / self.online_s if self.online_s else float("nan")

    @property
    def sample_goodput(self) -> float:
        """The issue's definition: samples averaged into the state over samples computed."""
        computed = self.trained + self.lost
        return self.counted / computed if computed else float("nan")

    @property
    def rate(self) -> float:
        return self.counted / self.window_s


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


class _Slot:
    """One peer's place in the lab: its namespace, key and checkpoint dir, its runs."""

    def __init__(self, sim: WanSim, name: str, workdir: Path, coordinator: str, announce: str | None) -> None:
        self.sim, self.name, self.workdir, self.coordinator = sim, name, workdir, coordinator
        self.announce = announce
        self.proc: subprocess.Popen[bytes] | None = None
        self.leaving_since: float | None = None
        """When a clean stop was asked of the running process (it finishes its round first)."""
        self.due = float("inf")
        """When (monotonic) this slot's next event falls: a leave while up, a join while down."""
        self.runs = 0
        self.started: list[float] = []
        self.stopped: list[float] = []
        """When each run ended: its process exited (a clean stop finishes its round first) or was killed."""
        self.killed: list[bool] = []

    def start(self) -> None:
        self.runs += 1
        argv = [*SW, "-v", "peer", "--coordinator", self.coordinator, "--host", "0.0.0.0", "--port", str(PEER_PORT)]
        argv += ["--announce", self.announce] if self.announce else []
        argv += ["--key", str(self.workdir / f"{self.name}.key")]
        argv += ["--checkpoint-dir", str(self.workdir / f"{self.name}-ckpt")]
        argv += ["--metrics-file", str(self.workdir / f"{self.name}.jsonl")]
        out = (self.workdir / f"{self.name}.{self.runs}.log").open("w")
        self.proc = self.sim.run(self.name, argv, stdout=out, stderr=subprocess.STDOUT, env=ONE_THREAD)
        self.started.append(time.time())

    def up(self) -> bool:
        """Running and not asked to leave."""
        return self.proc is not None and self.proc.poll() is None and self.leaving_since is None

    def down(self) -> bool:
        return self.proc is None

    def stop(self, clean: bool) -> None:
        """Ask a clean stop (``poll`` sees it through) or kill at once."""
        if self.proc is None:
            return
        if clean:
            os.kill(self.proc.pid, signal.SIGINT)
            self.leaving_since = time.monotonic()
            return
        self.end(killed=True)

    def poll(self) -> None:
        """A clean stop that ended is recorded; one past ``LEAVE_WAIT_S`` is killed."""
        if self.proc is None or self.leaving_since is None:
            return
        if self.proc.poll() is not None:
            self.end(killed=False)
        elif time.monotonic() - self.leaving_since > LEAVE_WAIT_S:
            self.end(killed=True)

    def end(self, *, killed: bool) -> None:
        """Record the run's end (``killed``: SIGKILL it and its children first) and reap it."""
        proc, self.proc, self.leaving_since = self.proc, None, None
        assert proc is not None
        self.stopped.append(time.time())  # from here on it does no work that can count
        self.killed.append(killed)
        if killed:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the peer and what it started (DHT, averager, p2pd)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def run(
    workdir: Path,
    *,
    churn: bool,
    peers: int = 12,
    churning: int = 4,
    window_s: float = 240.0,
    lifetime_s: float = 30.0,
    downtime_s: float = 15.0,
    coordinator_restarts: int = 1,
    phase_s: float = 8.0,
    seed: int = 0,
    subnet: str = "10.79.12.0/24",
    start_after: int = 3,
) -> ChurnFigures:
    """One run (the module docstring says what it measures)."""
    if not 2 <= peers - churning and churning >= 0:
        raise ValueError(f"need at least 2 steady peers, got {peers} peers of which {churning} churn")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(SPEC.format(codec="sparse", phase_s=phase_s, steps=100_000, density=""))
    figures = ChurnFigures(churn=churn, window_s=window_s)
    where = public_run(peers)
    names = list(where.places)
    churners = names[peers - churning :]
    rng = random.Random(seed)
    with WanSim(where.hosts, prefix="ch", subnet=subnet, **where.sim_kwargs()) as sim:  # type: ignore[arg-type]
        coordinator = LabCoordinator(sim, workdir, spec)
        coordinator.start()
        address = f"{coordinator.host}:7500"
        slots = {
            name: _Slot(
                sim,
                name,
                workdir,
                address,
                f"{sim.ip(name)}:{where.announce_ports[name]}" if name in where.announce_ports else None,
            )
            for name in names
        }
        for slot in slots.values():
            slot.start()
        end = time.monotonic() + 240
        while len([r for r in metrics_rows(workdir / f"{names[0]}.jsonl") if r["averaged"]]) < start_after:
            if time.monotonic() > end:
                raise RuntimeError(f"the swarm did not land {start_after} rounds; see {workdir}")
            time.sleep(0.5)
        opened = time.time()
        began = time.monotonic()
        restarts = [began + window_s * (k + 1) / (coordinator_restarts + 1) for k in range(coordinator_restarts)]
        back_at: float | None = None
        if churn:
            for name in churners:
                slots[name].due = began + rng.expovariate(1 / lifetime_s)
        while time.time() < opened + window_s:
            time.sleep(0.3)
            now = time.monotonic()
            for slot in slots.values():
                slot.poll()
            if not churn:
                continue
            if back_at is not None and now >= back_at:
                coordinator.start()
                figures.events.append("+coordinator")
                back_at = None
            if restarts and now >= restarts[0] and back_at is None:
                restarts.pop(0)
                coordinator.kill()
                figures.events.append("-coordinator kill")
                back_at = now + OUTAGE_S
            for name in churners:
                slot = slots[name]
                if now < slot.due:
                    continue
                if slot.up():
                    clean = rng.random() < 0.5
                    figures.events.append(f"-{name} {'clean' if clean else 'kill'}")
                    slot.stop(clean)
                    slot.due = now + rng.expovariate(1 / downtime_s)
                elif slot.down():
                    figures.events.append(f"+{name}")
                    slot.start()
                    slot.due = now + rng.expovariate(1 / lifetime_s)
        closed = time.time()
        if back_at is not None:
            coordinator.start()
        time.sleep(2 * phase_s + 60)  # the window's last rounds reported and finalized (a minute)
        finalized = _get(f"http://{coordinator.host}:8080/api/v1/rounds?limit=5000")
        for slot in slots.values():
            if slot.proc is not None:
                slot.end(killed=True)
        coordinator.stop()
    _figures(figures, workdir, slots, opened, closed, finalized, phase_s)
    figures.places = dict(where.places)
    figures.churners = churners
    return figures


def _figures(
    figures: ChurnFigures,
    workdir: Path,
    slots: dict[str, _Slot],
    opened: float,
    closed: float,
    finalized: list[dict[str, Any]],
    phase_s: float,
) -> None:
    states: dict[int, set[str]] = defaultdict(set)
    averaged_in: dict[int, int] = defaultdict(int)
    """Samples the rows say were averaged into each round's state."""
    landed: dict[int, float] = {}
    for slot in slots.values():
        rows = metrics_rows(workdir / f"{slot.name}.jsonl")
        for row in rows:
            if row["averaged"] and row["in_sync"]:
                landed[row["round"]] = min(landed.get(row["round"], row["at"]), row["at"])
            if contributed(row):
                averaged_in[row["round"]] += row["samples"] + row.get("carried", 0)
            if not opened <= row["at"] <= closed:
                continue
            figures.trained += row["samples"]
            if contributed(row):
                figures.counted += row["samples"] + row.get("carried", 0)
                figures.useful_s += row["compute_s"]
            if row["averaged"] and row["in_sync"]:
                states[row["round"]].add(row["state_digest"])
        streak = 0
        for row in rows:
            streak = 0 if contributed(row) else streak + 1
            figures.stuck_rows = max(figures.stuck_rows, streak)
        for index, started in enumerate(slot.started):
            stopped = slot.stopped[index] if index < len(slot.stopped) else closed
            figures.online_s += max(0.0, min(stopped, closed) - max(started, opened))
        speed = sum(r["samples"] for r in rows) / max(1e-9, sum(r["compute_s"] for r in rows)) if rows else 0.0
        for index, started in enumerate(slot.started):
            stopped = slot.stopped[index] if index < len(slot.stopped) else closed
            mine = [r for r in rows if started <= r["at"] <= stopped]
            if index < len(slot.killed) and slot.killed[index] and opened <= stopped <= closed:
                # its inner phase since the last row (or since its first phase began: its start,
                # less the time a first row of this slot took beyond its compute)
                since = mine[-1]["at"] if mine else started + STARTUP_S
                figures.lost += int(speed * min(phase_s, max(0.0, stopped - since)))
            first = next((r["at"] for r in mine if contributed(r)), None)
            until = first if first is not None else min(stopped, closed)  # a life that ended without one: to its end
            waited = len([t for t in landed.values() if started < t < until])
            figures.stuck_start_rounds = max(figures.stuck_start_rounds, waited)
            figures.lives.append(
                {
                    "slot": slot.name,
                    "online_s": round(max(0.0, min(stopped, closed) - max(started, opened)), 1),
                    "useful_s": round(
                        sum(r["compute_s"] for r in mine if contributed(r) and opened <= r["at"] <= closed), 1
                    ),
                    "first_row_s": round(mine[0]["at"] - started, 1) if mine else None,
                    "first_contribution_s": round(first - started, 1) if first is not None else None,
                    "rows": len(mine),
                    "contributing": len([r for r in mine if contributed(r)]),
                }
            )
    figures.rounds = len([r for r, t in landed.items() if opened <= t <= closed])
    figures.two_states = len([r for r, digests in states.items() if len(digests) > 1])
    for row in finalized:
        if row["round"] in averaged_in:
            figures.credited_rounds += 1
            figures.credit_lost += max(0, averaged_in[row["round"]] - row["samples"])


def _markdown(results: list[ChurnFigures], args: argparse.Namespace) -> str:
    base, churned = results
    ratio = churned.sample_goodput / base.sample_goodput if base.sample_goodput else float("nan")
    time_ratio = churned.goodput / base.goodput if base.goodput else float("nan")
    kinds = {place: sum(1 for p in churned.places.values() if p == place) for place in PLACES}
    churning = ", ".join(f"{name} ({churned.places[name]})" for name in churned.churners)
    joins = sum(1 for e in churned.events if e.startswith("+p"))
    leaves = sum(1 for e in churned.events if e.startswith("-p"))
    lines = [
        f"# A public run's lab: {args.peers} volunteers, {args.churning} of them coming and going "
        f"({datetime.date.today()})",
        "",
        f'`make bench-churn CHURN_ARGS="--peers {args.peers} --churning {args.churning} --window-s {args.window_s:g} '
        f"--lifetime-s {args.lifetime_s:g} --downtime-s {args.downtime_s:g} "
        f'--coordinator-restarts {args.coordinator_restarts} --phase-s {args.phase_s:g} --seed {args.seed}"` (as root)',
        "",
        f"A coordinator (datacenter) and {args.peers} peers train the demo's model (137K parameters) with sparse "
        f"averaging and {args.phase_s:g} s inner phases: {kinds['datacenter']} in datacenters (1 Gbit/s, 2.5 ms one "
        f"way), {kinds['rented']} on rented GPUs behind port mappings (1 Gbit/s, 10 ms), {kinds['home']} at home "
        "behind NAT (50 Mbit/s, 20 ms; relays and punched holes). In the churning run "
        f"{churning} come and go on Poisson clocks (up {args.lifetime_s:g} s on average, down "
        f"{args.downtime_s:g} s; half the leaves clean, half SIGKILLs), and the coordinator is SIGKILLed "
        f"{args.coordinator_restarts} time(s) and back {OUTAGE_S:g} s later. Figures over a {args.window_s:g} s "
        "window from the peers' metrics rows and the coordinator's API (`benchmarks/churn.py` says how each is "
        "counted).",
        "",
        "| run | joins / leaves | rounds landed | peer-seconds online | goodput | time goodput | samples trained | "
        "lost by kills (estimated) | averaged into the state | "
        "samples/s into the state | rounds with two states | most rounds to a first contribution | "
        "longest non-contributing streak | credit lost (rounds compared) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        j = sum(1 for e in r.events if e.startswith("+p"))
        lv = sum(1 for e in r.events if e.startswith("-p"))
        lines.append(
            f"| {'churning' if r.churn else 'churn-free'} | {j} / {lv} | {r.rounds} | {r.online_s:.0f} | "
            f"{r.sample_goodput:.1%} | {r.goodput:.1%} | {r.trained} | {r.lost} | {r.counted} | {r.rate:.0f} | "
            f"{r.two_states} | {r.stuck_start_rounds} | {r.stuck_rows} | {r.credit_lost} ({r.credited_rounds}) |"
        )
    per_round = (joins + leaves) / churned.rounds if churned.rounds else float("nan")
    lines += [
        "",
        f"Goodput, churning against churn-free: **{ratio:.1%}** (issue #49 asks at least 90%); "
        f"time goodput: {time_ratio:.1%}. Joins and leaves per round landed: {per_round:.2f}.",
        "",
    ]
    lines.append(f"Events of the churning run: {' '.join(churned.events)}")
    lines += [
        "",
        "Each churning peer's runs (seconds; first row / first contribution counted from its start):",
        "",
        "| peer | place | online | contributing inner steps | first row | first contribution | rows (contributing) |",
        "|---|---|---|---|---|---|---|",
    ]
    for life in churned.lives:
        if life["online_s"] > 0 and life["slot"] in churned.churners:
            lines.append(
                f"| {life['slot']} | {churned.places.get(life['slot'], '')} | {life['online_s']:.0f} | "
                f"{life['useful_s']:.0f} | {life['first_row_s']} | {life['first_contribution_s']} | "
                f"{life['rows']} ({life['contributing']}) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=12)
    parser.add_argument("--churning", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=240.0)
    parser.add_argument("--lifetime-s", type=float, default=30.0)
    parser.add_argument("--downtime-s", type=float, default=15.0)
    parser.add_argument("--coordinator-restarts", type=int, default=1)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's logs and rows under this folder")
    args = parser.parse_args(argv)
    results = []
    try:
        for churn in (False, True):
            with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
                workdir = args.keep / ("churning" if churn else "churn-free") if args.keep else Path(tmp)
                results.append(
                    run(
                        workdir,
                        churn=churn,
                        peers=args.peers,
                        churning=args.churning,
                        window_s=args.window_s,
                        lifetime_s=args.lifetime_s,
                        downtime_s=args.downtime_s,
                        coordinator_restarts=args.coordinator_restarts,
                        phase_s=args.phase_s,
                        seed=args.seed,
                    )
                )
    except NotRootError as exc:
        print(f"churn: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"churn-lab-{stamp}.md").write_text(_markdown(results, args))
    rows = [{**asdict(r), "goodput": r.sample_goodput, "time_goodput": r.goodput, "rate": r.rate} for r in results]
    (args.out / f"churn-lab-{stamp}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(_markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
