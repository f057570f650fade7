"""Injected failures at scale (issue #49): a swarm that is killed, left, joined and cut off from its
coordinator more than a thousand times, and must lose no credit and never land two states.

    make bench-soak SOAK_ARGS="[--failures 1200] [--every-s 2.5] [--minutes 80]"   (as root)

A coordinator and six peer slots train the demo's model (rounds of a ``--phase-s`` inner phase)
in network namespaces: ``d0`` and ``d1`` on direct 50mbit links (each also relays for peers
nobody can dial), ``n0`` behind its own NAT with hole punching off (reached through ``d0``'s or
``d1``'s relay), and ``c0``-``c2`` on 4mbit links (a state download takes a few seconds there).
Every ``--every-s`` one failure is injected, in turn from this list, onto a slot it fits:

- ``kill-averaging``: SIGKILL (with its process group: a lost machine) a peer that has launched
  its round and is looking for its group or averaging (its log's last ``averaging round``
  line is newer than its last landed round);
- ``kill-download``: start a stopped peer (one on a 4mbit link where one is stopped) and SIGKILL
  it once it is downloading the swarm's state or rolling it forward (``kill-starting`` if it is
  still starting ``3 * FIT_WAIT_S`` later);
- ``kill-landing``: SIGKILL a peer as soon as it says its round averaged and it is landing it
  (the landing, the digest record, the checkpoint write);
- ``leave``: SIGTERM (``docker stop``) a peer that has landed a round in this run (a clean
  leave: it finishes its round, says so, exits; one still there a minute later is SIGKILLed, said);
- ``join``: start a stopped peer (with its key and checkpoint dir: it resumes or downloads);
- ``relay-death``: SIGKILL the direct peer that relays for ``n0`` (both are its relays; the
  other dies another time), restarted at a later ``join``;
- every ``--coordinator-every`` failures, ``coordinator-kill``: SIGKILL the coordinator (with
  its relay and DHT node) and start it again on the same state after ``--outage-s``.

The soak is two runs of half the failures each, the same but for the coordinator's database:
SQLite in its state dir, then PostgreSQL (a throwaway server in the coordinator's namespace,
``.ci/postgres.sh``; that run is skipped, and said so, where it cannot be started).

Failures begin once the swarm has landed ``START_AFTER`` rounds. At least ``--min-up`` peers are kept running (a kill or leave that would go below it waits for
a join). A run ends after its failures or half of ``--minutes`` minutes, whichever comes first; then every peer is stopped cleanly, and the coordinator is given time to finalize.

Figures (from the peers' metrics rows, their logs and the coordinator's API): failures
injected, by kind; failures survived (a round landed in one state, in a group of two or more,
within ``SURVIVE_S`` of it); rounds landed; rounds whose averaged members hold more than one
state; credits lost (for each round the peers' rows say they averaged into the state, the samples
they contributed less those the coordinator credited, summed where positive: a round it never
finalized lost them all); the longest time the swarm
landed nothing. Writes ``soak-<date>.md``/``.json`` under ``--out`` (default
``benchmarks/results``). Needs root (namespaces); says so and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lab_coordinator import LabCoordinator
from benchmarks.netsim import Nat, NotRootError, WanSim
from benchmarks.slow_join import ONE_THREAD, SPEC, SW, contributed, metrics_rows, wait_for

ROOT = Path(__file__).resolve().parents[1]
DIRECT = ("d0", "d1")
BEHIND = ("n0",)
SLOW = ("c0", "c1", "c2")
KINDS = ("kill-averaging", "join", "kill-download", "leave", "kill-landing", "join", "relay-death", "join")
"""The order failures are injected in (joins are as many as the stops, so the swarm stays up)."""
SURVIVE_S = 120.0
"""A failure is survived when a round lands (one state, two or more members) within this."""
FIT_WAIT_S = 15.0
"""How long a timed kill waits for its moment (a peer averaging, downloading, landing)."""
LEAVE_WAIT_S = 60.0
TAIL_BYTES = 16_384
POLL_S = 0.05
START_AFTER = 3
"""Rounds the swarm lands before the first failure."""

_AVERAGING = re.compile(r"averaging round (\d+): ")
_LANDED = re.compile(r"^round +(\d+) \|", re.MULTILINE)
_LANDING = re.compile(r"round (\d+) averaged in a group of \d+: landing it")
_DOWNLOADING = re.compile(r"downloading the swarm's state|rolling forward at round")


@dataclass
class SoakFigures:
    database: str = "sqlite"
    injected: dict[str, int] = field(default_factory=dict)
    survived: int = 0
    failures: int = 0
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """(when, kind, slot) of each failure."""
    rounds: int = 0
    two_states: int = 0
    credit_lost: int = 0
    credited_rounds: int = 0
    """Rounds compared: every round the peers' rows say they averaged into the state."""
    uncredited_rounds: int = 0
    """Of those, rounds the coordinator finalized nothing of."""
    longest_gap_s: float = 0.0
    minutes: float = 0.0
    skipped: list[str] = field(default_factory=list)


class _Slot:
    def __init__(self, sim: WanSim, name: str, workdir: Path, coordinator: str, *, nat: bool) -> None:
        self.sim, self.name, self.workdir, self.coordinator, self.nat = sim, name, workdir, coordinator, nat
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.leaving: list[tuple[subprocess.Popen[bytes], float]] = []
        """Peers asked to leave, with when they are killed if still there."""

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.{self.runs}.log"

    def size(self) -> int:
        return self.log.stat().st_size if self.runs and self.log.exists() else 0

    def text(self, since: int | None = None) -> str:
        """Its current run's log from byte ``since`` (None: its last ``TAIL_BYTES``): polled every
        few tens of milliseconds, so never the whole file."""
        if not self.runs or not self.log.exists():
            return ""
        with self.log.open("rb") as log:
            start = since if since is not None else max(0, self.size() - TAIL_BYTES)
            log.seek(start)
            return log.read().decode(errors="replace")

    def start(self) -> None:
        self.runs += 1
        argv = [*SW, "-v", "peer", "--coordinator", self.coordinator, "--host", "0.0.0.0", "--port", "7700"]
        argv += ["--key", str(self.workdir / f"{self.name}.key")]
        argv += ["--checkpoint-dir", str(self.workdir / f"{self.name}-ckpt")]
        argv += ["--metrics-file", str(self.workdir / f"{self.name}.jsonl")]
        if self.nat:
            argv.append("--no-hole-punch")
        out = self.log.open("w")
        self.proc = self.sim.run(self.name, argv, stdout=out, stderr=subprocess.STDOUT, env=ONE_THREAD)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def leave(self) -> None:
        """``docker stop`` (SIGTERM; a Ctrl-C's SIGINT is ignored by a background job's children
        until the peer installs its handler): it finishes its round and exits; reaped later."""
        proc, self.proc = self.proc, None
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            self.leaving.append((proc, time.monotonic() + LEAVE_WAIT_S))

    def reap(self, *, deadline_s: float = 0.0) -> None:
        """Collect the peers that left; one still there ``LEAVE_WAIT_S`` after it was asked
        (or, with ``deadline_s``, after that) is SIGKILLed, said, and collected."""
        end = time.monotonic() + deadline_s
        for proc, due in list(self.leaving):
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not deadline_s and time.monotonic() < due:
                    continue
                print(f"soak: {self.name} did not leave within {LEAVE_WAIT_S:.0f} s: killed", flush=True)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            self.leaving.remove((proc, due))

    def training(self) -> bool:
        """Its current run has landed a round (it handles a stop request by then)."""
        return bool(_LANDED.search(self.text()))

    def averaging(self) -> bool:
        """It launched a round that has not landed yet."""
        text = self.text()
        launched = [m.start() for m in _AVERAGING.finditer(text)]
        landed = [m.start() for m in _LANDED.finditer(text)]
        return bool(launched) and (not landed or launched[-1] > landed[-1])

    def landing(self, since: int) -> bool:
        """It said it is landing a round after byte ``since`` of its log."""
        return bool(_LANDING.search(self.text(since)))

    def downloading(self) -> bool:
        return bool(_DOWNLOADING.search(self.text()))


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _postgres(sim: WanSim, workdir: Path) -> str | None:
    """A throwaway PostgreSQL server in the coordinator's namespace (its URL), or None."""
    done = sim.exec(
        "coord", ["bash", str(ROOT / ".ci" / "postgres.sh"), "start", str(workdir / "pg"), "55432"], timeout=300
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def run(
    workdir: Path,
    *,
    failures: int = 1200,
    every_s: float = 2.5,
    minutes: float = 40.0,
    phase_s: float = 4.0,
    coordinator_every: int = 100,
    outage_s: float = 20.0,
    min_up: int = 3,
    database: str = "sqlite",
    subnet: str = "10.79.14.0/24",
) -> SoakFigures:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    spec.write_text(SPEC.format(codec="sparse", phase_s=phase_s, steps=100_000, density=""))
    figures = SoakFigures(database=database)
    names = [*DIRECT, *BEHIND, *SLOW]
    rates = {name: "4mbit" for name in SLOW}
    with WanSim(
        ["coord", *names], rate="50mbit", rates=rates, prefix="sk", subnet=subnet, nat=dict.fromkeys(BEHIND, Nat())
    ) as sim:
        coordinator = LabCoordinator(sim, workdir, spec)
        if database == "postgresql":
            coordinator.db = _postgres(sim, workdir)
            if coordinator.db is None:
                figures.skipped.append("PostgreSQL could not be started here: no run on it")
                return figures
        coordinator.start()
        address = f"{sim.ip('coord')}:7500"
        slots = {name: _Slot(sim, name, workdir, address, nat=name in BEHIND) for name in names}
        for name in DIRECT:
            slots[name].start()
        for name in DIRECT:
            wait_for(slots[name].log, r"^relay: serving peers", 90)
        for name in (*BEHIND, *SLOW):
            slots[name].start()
        _until_landed(workdir, names, START_AFTER)
        began = time.monotonic()
        doomed: dict[str, float] = {}
        """Peers started to be killed mid-download, with their deadlines."""
        next_outage, next_progress = coordinator_every, 50
        turn = 0
        while figures.failures < failures and time.monotonic() - began < minutes * 60:
            for slot in slots.values():
                slot.reap()
            _reap_downloads(slots, figures, doomed)
            if figures.failures >= next_outage:
                next_outage += coordinator_every
                coordinator.kill()
                _note(figures, "coordinator-kill", "coord")
                time.sleep(outage_s)
                coordinator.start()
                continue
            kind = KINDS[turn % len(KINDS)]
            turn += 1
            if _inject(kind, slots, figures, doomed, min_up):
                if figures.failures >= next_progress:
                    next_progress += 50
                    _progress(figures, workdir, names)
                time.sleep(every_s)
        figures.minutes = (time.monotonic() - began) / 60
        for slot in slots.values():
            if slot.running():
                slot.leave()
        for slot in slots.values():
            slot.reap(deadline_s=LEAVE_WAIT_S)
        time.sleep(75)  # the last rounds' claims finalized (the coordinator's by-time finalization)
        finalized = _get(f"http://{sim.ip('coord')}:8080/api/v1/rounds?limit=5000")
        coordinator.stop()
        if coordinator.db:
            sim.exec("coord", ["bash", str(ROOT / ".ci" / "postgres.sh"), "stop", str(workdir / "pg")], timeout=120)
    _figures(figures, workdir, names, finalized)
    return figures


def _until_landed(workdir: Path, names: list[str], rounds: int, deadline_s: float = 240.0) -> None:
    end = time.monotonic() + deadline_s
    while len({r["round"] for n in names for r in metrics_rows(workdir / f"{n}.jsonl") if contributed(r)}) < rounds:
        if time.monotonic() > end:
            raise RuntimeError(f"the swarm did not land {rounds} rounds; see {workdir}")
        time.sleep(0.5)


def _progress(figures: SoakFigures, workdir: Path, names: list[str]) -> None:
    rows = [row for name in names for row in metrics_rows(workdir / f"{name}.jsonl")]
    rounds = len({row["round"] for row in rows if contributed(row)})
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(figures.injected.items()))
    print(f"soak ({figures.database}): {figures.failures} failures ({kinds}); {rounds} rounds landed", flush=True)


def _note(figures: SoakFigures, kind: str, slot: str) -> None:
    figures.failures += 1
    figures.injected[kind] = figures.injected.get(kind, 0) + 1
    figures.events.append((time.time(), kind, slot))


def _reap_downloads(slots: dict[str, _Slot], figures: SoakFigures, doomed: dict[str, float]) -> None:
    """Kill each peer started to be killed mid-download once its log says it downloads (or,
    past its deadline, while it is still starting)."""
    for name, deadline in list(doomed.items()):
        slot = slots[name]
        if not slot.running():
            del doomed[name]
        elif slot.downloading() or time.monotonic() > deadline:
            slot.kill()
            del doomed[name]
            _note(figures, "kill-download" if slot.downloading() else "kill-starting", name)


def _inject(kind: str, slots: dict[str, _Slot], figures: SoakFigures, doomed: dict[str, float], min_up: int) -> bool:
    """Inject one failure of ``kind`` if some slot fits it; whether one was."""
    up = [s for s in slots.values() if s.running() and s.name not in doomed]
    down = [s for s in slots.values() if not s.running() and not s.leaving and s.name not in doomed]
    if kind == "join":
        if not down:
            return False
        slot = min(down, key=lambda s: s.runs)
        slot.start()
        _note(figures, kind, slot.name)
        return True
    if kind == "kill-download":
        if not down:
            return False
        slot = min(down, key=lambda s: (s.name not in SLOW, s.runs))  # a slow link's download lasts seconds
        slot.start()
        doomed[slot.name] = time.monotonic() + 3 * FIT_WAIT_S  # killed by ``_reap_downloads``
        return True
    if len(up) <= min_up:
        return False
    if kind == "leave":
        ready = [s for s in up if s.training()]
        if not ready:
            return False
        slot = ready[figures.failures % len(ready)]
        slot.leave()
        _note(figures, kind, slot.name)
        return True
    if kind == "relay-death":
        relays = [s for s in up if s.name in DIRECT]
        if len(relays) < 2:
            return False  # n0 keeps one relay; the other comes back at a join
        slot = relays[figures.injected.get("relay-death", 0) % 2]
        slot.kill()
        _note(figures, kind, slot.name)
        return True
    marks = {slot.name: slot.size() for slot in up}
    end = time.monotonic() + FIT_WAIT_S
    while time.monotonic() < end:
        for slot in up:
            if not slot.running():
                continue
            if (kind == "kill-averaging" and slot.averaging()) or (
                kind == "kill-landing" and slot.landing(marks[slot.name])
            ):
                slot.kill()
                _note(figures, kind, slot.name)
                return True
        time.sleep(POLL_S)
    return False


def _figures(figures: SoakFigures, workdir: Path, names: list[str], finalized: list[dict[str, Any]]) -> None:
    states: dict[int, set[str]] = defaultdict(set)
    averaged_in: dict[int, int] = defaultdict(int)
    landed: dict[int, float] = {}
    for name in names:
        for row in metrics_rows(workdir / f"{name}.jsonl"):
            if contributed(row):
                averaged_in[row["round"]] += row["samples"] + row.get("carried", 0)
                landed[row["round"]] = min(landed.get(row["round"], row["at"]), row["at"])
            if row["averaged"] and row["in_sync"]:
                states[row["round"]].add(row["state_digest"])
    figures.rounds = len(landed)
    figures.two_states = len([r for r, digests in states.items() if len(digests) > 1])
    times = sorted(landed.values())
    figures.longest_gap_s = round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 1)
    figures.survived = len([e for e in figures.events if any(e[0] < t <= e[0] + SURVIVE_S for t in times)])
    credited = {row["round"]: row["samples"] for row in finalized}
    for round_, samples in averaged_in.items():
        # a round no claim of which the coordinator finalized (none arrived, or all were
        # denied) credited nothing: all of its samples are lost
        figures.credited_rounds += 1
        figures.credit_lost += max(0, samples - credited.get(round_, 0))
        figures.uncredited_rounds += round_ not in credited


def _markdown(results: list[SoakFigures], args: argparse.Namespace) -> str:
    lines = [
        f"# Injected failures at scale ({datetime.date.today()})",
        "",
        f'`make bench-soak SOAK_ARGS="--failures {args.failures} --every-s {args.every_s:g} --minutes {args.minutes:g}"` (as root)',
        "",
        "A coordinator and six peer slots (two direct relays, one NAT'ed peer, three on 4mbit links) train the demo's "
        f"model with {args.phase_s:g} s inner phases; a failure every {args.every_s:g} s, a coordinator SIGKILL every "
        f"{args.coordinator_every} ({args.outage_s:g} s down); two runs, the coordinator on SQLite then on PostgreSQL. "
        "`benchmarks/soak.py` says what each failure is and how each figure is counted.",
        "",
        "| database | failures injected | survived (a round landed within "
        f"{SURVIVE_S:.0f} s) | rounds landed | rounds with two states | credits lost (rounds compared) | "
        "rounds credited nothing | longest time with no round landed | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.database} | {r.failures} | {r.survived} | {r.rounds} | {r.two_states} | "
            f"{r.credit_lost} ({r.credited_rounds}) | {r.uncredited_rounds} | {r.longest_gap_s} s | {r.minutes:.1f} |"
        )
    total: Counter[str] = Counter()
    for r in results:
        total.update(r.injected)
    lines += [
        "",
        f"Failures injected, both runs: **{sum(r.failures for r in results)}** "
        f"({', '.join(f'{kind} {count}' for kind, count in sorted(total.items()))}); credits lost "
        f"{sum(r.credit_lost for r in results)}, rounds with two states {sum(r.two_states for r in results)}.",
    ]
    lines += [f"\n{note}" for r in results for note in r.skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", type=int, default=1200)
    parser.add_argument("--every-s", type=float, default=2.5)
    parser.add_argument("--minutes", type=float, default=80.0)
    parser.add_argument("--phase-s", type=float, default=4.0)
    parser.add_argument("--coordinator-every", type=int, default=100)
    parser.add_argument("--outage-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--keep", type=Path, default=None, help="keep the run's logs and rows in this folder")
    args = parser.parse_args(argv)
    results = []
    try:
        for database in ("sqlite", "postgresql"):
            with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
                results.append(
                    run(
                        args.keep / database if args.keep else Path(tmp),
                        failures=args.failures // 2,
                        every_s=args.every_s,
                        minutes=args.minutes / 2,
                        phase_s=args.phase_s,
                        coordinator_every=args.coordinator_every,
                        outage_s=args.outage_s,
                        database=database,
                    )
                )
    except NotRootError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"soak-{stamp}.md").write_text(_markdown(results, args))
    (args.out / f"soak-{stamp}.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(_markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
