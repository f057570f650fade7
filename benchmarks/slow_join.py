"""A volunteer on a home link joins a running swarm: its link is 10x slower than the swarm's, so
its state download spans several rounds. Does it get in, and how soon does its work count?

    make bench-join JOIN_ARGS="[--slow 220kbit] [--fast 2200kbit] [--codec sparse] [--phase-s 8]"   (as root)

A coordinator and three peers on fast links (``--fast``) train the demo's model with rounds of a
fixed inner phase (``--phase-s``, 8 s); they resume a run at round 100 (each from a checkpoint of
the run's initial model at that round: a swarm that has run for a while, whose rounds the
newcomer cannot roll its initial state forward by), and once they have landed 3 rounds a fourth
peer starts on a slow link (``--slow``). Run three times in one invocation, the same links: members
keeping the last 16 rounds' averaged updates (the shipped ``--keep-updates``), sparse at density 1/16 (the newcomer rolls its
downloaded state forward by them, ``peer.round.host_passes.roll_forward``), then keeping none
(``--keep-updates 0``: the newcomer downloads whole states until one is still the swarm's when it
arrives), then keeping 16 at the default density 1/4 (updates 4x the bytes: rolling D rounds costs
about D² times an update's share of a state, in rounds, so the denser codec's join is slower). Figures, each from the
peers' own logs and metrics rows (``at``: when a row was recorded): the newcomer's state
download time, the rounds it spans (against the median round of a member meanwhile), the time
from the start of its download to its first contribution (its first round averaged in the
swarm's state with samples), and how many rounds it rolled forward. Writes
``slow-join-<date>.md``/``.json`` under ``--out`` (default ``benchmarks/results``). Needs root
(namespaces); says so and exits 2 otherwise.

``tests/integration/test_slow_joiner.py`` runs the first of the three and holds it to one
download, a roll forward and a contribution; how soon (the issue's bound: a first contribution
within the download time plus two rounds) is this benchmark's figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.netsim import NotRootError, WanSim
from engine.update_store import KEPT_ROUNDS

SW = [sys.executable, "-m", "swarmtrain"]
SPEC = """
[run]
name = "slow-join"
[task]
kind = "bytegpt"
[task.model]
d_model = 64
n_layers = 2
n_heads = 4
context = 64
[data]
source = "stdlib"
seed = 0
[inner]
lr = 1e-3
batch_size = 8
grad_clip = 1.0
[rounds]
inner_steps = {steps}
time_budget_s = {phase_s}
max_rounds = 1000
[outer]
lr = 0.7
momentum = 0.9
nesterov = true
[averaging]
compression = "{codec}"{density}
min_group_size = 2
matchmaking_timeout_s = 10.0
allreduce_timeout_s = 30.0
[admission]
mode = "open"
"""
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
"""Each peer computes on one thread: three peers and a coordinator share this machine's two cores
(torch's default of one thread per core has them fight over both, and all-reduces time out)."""
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
DOWNLOADING = re.compile(r"downloading the swarm's state of round (\d+)")
DOWNLOADED = re.compile(r"downloaded the state of round (\d+) in ([\d.]+) s")
ADOPTED = "adopted the swarm's state of round"
ROLLED = re.compile(r"rolled the downloaded state forward by (\d+) rounds")


@dataclass
class JoinFigures:
    """One newcomer's join, from its log and rows and a member's rows."""

    keep_updates: int
    density: float
    """The sparse codec's share of values sent a round (an update is ~0.98% of a state at 1/4,
    ~0.25% at 1/16)."""
    download_s: float
    """Its first state download, start to end."""
    downloads: int
    """State downloads it started before it got in."""
    round_s: float
    """A member's median round (landing to landing) before the newcomer came, its first left out."""
    rolled: int
    """Rounds it rolled its downloaded state forward by."""
    first_contribution_s: float | None
    """From the start of its first download to its first round averaged in the swarm's state
    with samples; None if it never contributed before the deadline."""
    adopted_s: float | None = None
    """From the start of its first download to its first adoption of the swarm's state."""

    @property
    def spans(self) -> float:
        return self.download_s / self.round_s

    @property
    def bound_s(self) -> float:
        """The issue's bound: download time plus two rounds."""
        return self.download_s + 2 * self.round_s


def _stamp(line: str) -> float | None:
    found = STAMP.match(line)
    if not found:
        return None
    return datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(log: Path, pattern: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if re.search(pattern, log.read_text() if log.exists() else "", re.MULTILINE):
            return
        time.sleep(0.3)
    raise RuntimeError(f"{log.name} never printed {pattern!r}:\n{log.read_text()[-3000:] if log.exists() else ''}")


def contributed(row: dict[str, Any]) -> bool:
    return bool(row["averaged"] and row["in_sync"] and row["samples"] > 0 and row["group_size"] >= 2)


def run(
    workdir: Path,
    *,
    slow: str = "220kbit",
    fast: str = "2200kbit",
    codec: str = "sparse",
    density: float = 1 / 16,
    keep_updates: int = KEPT_ROUNDS,
    start_after: int = 3,
    resume_at: int = 100,
    phase_s: float = 8.0,
    deadline_s: float = 240.0,
    subnet: str = "10.79.7.0/24",
    until_adopted: bool = False,
    steps: int = 100_000,
    debug: bool = False,
) -> JoinFigures:
    """One run (see the module docstring); the figures of the newcomer's join. With
    ``until_adopted`` it ends once the newcomer holds the swarm's state (no first contribution
    is waited for). ``steps``: inner steps per phase at most (the default: the phase is the time
    budget, as a real run's; a few steps leave the machine idle while rounds average). ``debug``:
    the newcomer logs at debug level (its log then times each read and download). ``resume_at``:
    the round the members resume the run at (0: they start it). ``deadline_s``: the members'
    first ``start_after`` rounds, then the newcomer's join from its start, each within it."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.toml"
    shares = f"\ndensity = {density}" if codec == "sparse" else ""
    spec.write_text(SPEC.format(codec=codec, phase_s=phase_s, steps=steps, density=shares))
    for name in ("p0", "p1", "p2"):
        if resume_at:
            _initial_checkpoint(spec, workdir / f"{name}-ckpt", resume_at)
    hosts = ["coord", "p0", "p1", "p2", "late"]
    with WanSim(hosts, rate=fast, rates={"late": slow}, prefix="sj", subnet=subnet) as sim:
        host = sim.ip("coord")
        log = workdir / "coordinator.log"
        argv = [*SW, "-v", "coordinator", "--spec", str(spec), "--state-dir", str(workdir / "coordinator")]
        argv += ["--host", host, "--grpc-port", "7500", "--dht-port", "7600", "--http-port", "8080"]
        sim.run("coord", argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(log, r"^peers join with:", 60)
        coordinator = f"{host}:7500"

        def peer(name: str) -> subprocess.Popen[bytes]:
            # the members niced: their phases last the time budget whatever CPU they get, and the
            # lab must not starve what runs beside it (the suite's other lane)
            argv = ["nice", "-n", "10"] if name != "late" else []
            verbose = ["-v", "-v"] if debug and name == "late" else ["-v"]
            argv += [*SW, *verbose, "peer", "--coordinator", coordinator, "--host", "0.0.0.0", "--port", "7700"]
            argv += ["--key", str(workdir / f"{name}.key"), "--checkpoint-dir", str(workdir / f"{name}-ckpt")]
            argv += ["--metrics-file", str(workdir / f"{name}.jsonl"), "--keep-updates", str(keep_updates)]
            out = (workdir / f"{name}.log").open("w")
            return sim.run(name, argv, stdout=out, stderr=subprocess.STDOUT, env=ONE_THREAD)

        members = [peer("p0"), peer("p1"), peer("p2")]
        end = time.monotonic() + deadline_s
        while len([r for r in metrics_rows(workdir / "p0.jsonl") if r["averaged"]]) < start_after:
            if time.monotonic() > end or any(p.poll() is not None for p in members):
                raise RuntimeError(
                    f"the swarm did not land {start_after} rounds in {deadline_s:g} s; what each peer said:\n"
                    f"{timeline(workdir)}"
                )
            time.sleep(0.3)
        # the newcomer's own time from its start: niced members on a machine shared with other
        # work can take most of a common deadline to start, and its join is what is measured
        late, end = peer("late"), time.monotonic() + deadline_s

        def done() -> bool:
            if until_adopted:
                return ADOPTED in (workdir / "late.log").read_text()
            return any(contributed(r) for r in metrics_rows(workdir / "late.jsonl"))

        while not done() and time.monotonic() < end:
            if late.poll() is not None:
                raise RuntimeError(f"the newcomer exited; see {workdir / 'late.log'}")
            time.sleep(0.3)
    return _figures(workdir, keep_updates, density)


def _initial_checkpoint(spec_path: Path, directory: Path, round_: int) -> None:
    """A checkpoint of the run's initial model (the state every peer starts from) as the state
    of ``round_``: members that restore it resume the run there, all holding one state."""
    import torch

    from engine.checkpoint import Checkpointer
    from peer.round.state import flatten
    from peer.task import build_task
    from protocol.spec import load_spec

    spec = load_spec(spec_path)
    model = build_task(spec, shard_seed=0).model
    params = flatten(model)
    record = {
        "round": round_,
        "params": params,
        "momentum": torch.zeros_like(params),
        "model": model.state_dict(),
        "inner_optimizer": None,
        "residual": None,
        "inner_steps_done": 0,
        "data_round": round_ - 1,
    }
    Checkpointer(directory, spec_digest=spec.digest()).save(record)


def _figures(workdir: Path, keep_updates: int, density: float) -> JoinFigures:
    lines = (workdir / "late.log").read_text().splitlines()
    starts = [t for line in lines if DOWNLOADING.search(line) and (t := _stamp(line)) is not None]
    durations = [float(m.group(2)) for line in lines if (m := DOWNLOADED.search(line))]
    rolled = sum(int(m.group(1)) for line in lines if (m := ROLLED.search(line)))
    if not starts or not durations:
        what = "finished downloading" if starts else "started downloading"
        raise RuntimeError(f"the newcomer never {what} a state; what each peer said:\n{timeline(workdir)}")
    started, download_s = starts[0], durations[0]
    member = [r["at"] for r in metrics_rows(workdir / "p0.jsonl") if r["averaged"]]
    before = [b - a for a, b in zip(member, member[1:]) if b <= started]
    round_s = statistics.median(before[1:]) if len(before) > 1 else float("nan")
    first = next((r["at"] for r in metrics_rows(workdir / "late.jsonl") if contributed(r)), None)
    adopted = next((t for line in lines if ADOPTED in line and (t := _stamp(line)) is not None), None)
    return JoinFigures(
        keep_updates=keep_updates,
        density=density,
        download_s=download_s,
        downloads=len(starts),
        round_s=round_s,
        rolled=rolled,
        first_contribution_s=None if first is None else first - started,
        adopted_s=None if adopted is None else adopted - started,
    )


TOLD = re.compile(r" (INFO|WARN\w*|ERROR) | \| (group|loss) ")


def timeline(workdir: Path, last: int = 60) -> str:
    """What each peer said from the newcomer's start on (its INFO and WARNING lines and its
    rounds' rows, the members' too, by time): the figures' story, for a failed check."""
    lines = (workdir / "late.log").read_text().splitlines() if (workdir / "late.log").exists() else []
    started = next((t for line in lines if (t := _stamp(line)) is not None), 0.0)
    told: list[tuple[float, str]] = []
    for name in ("late", "p0", "p1", "p2"):
        path = workdir / f"{name}.log"
        at = started
        for line in path.read_text().splitlines() if path.exists() else []:
            at = _stamp(line) or at  # a row without a stamp: after the line before it
            if at >= started and TOLD.search(line):
                told.append((at, f"{name:>4} {line[:220]}"))
    told.sort(key=lambda entry: entry[0])
    return "\n".join(line for _, line in told[-last:])


def _markdown(results: list[JoinFigures], args: argparse.Namespace) -> str:
    lines = [
        f"# A newcomer on a link 10x slower than the swarm's ({datetime.date.today()})",
        "",
        f'`make bench-join JOIN_ARGS="--slow {args.slow} --fast {args.fast} --codec {args.codec} '
        f'--phase-s {args.phase_s:g}"` (as root)',
        "",
        "Three members and a coordinator on fast links train the demo's model (137K parameters, a 1.1 MB "
        f"state) with {args.codec} averaging at the density each row says and {args.phase_s:g} s inner phases, "
        "resuming a run at round 100; "
        "after they land 3 rounds a newcomer starts on the slow link. Times from the start of its first state "
        "download.",
        "",
        "| sparse density | members keep | download | rounds it spans | state downloads | rolled forward | "
        "holds the swarm's state | first contribution | bound (download + 2 rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        first = "none before the deadline" if r.first_contribution_s is None else f"{r.first_contribution_s:.1f} s"
        adopted = "never" if r.adopted_s is None else f"{r.adopted_s:.1f} s"
        lines.append(
            f"| 1/{round(1 / r.density)} | {r.keep_updates} rounds | {r.download_s:.1f} s | {r.spans:.1f} (round {r.round_s:.2f} s) | "
            f"{r.downloads} | {r.rolled} rounds | {adopted} | {first} | {r.bound_s:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", default="220kbit")
    parser.add_argument("--fast", default="2200kbit")
    parser.add_argument("--codec", default="sparse")
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--deadline-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's logs and rows under this folder")
    parser.add_argument("--only", choices=("1/16", "none", "1/4"), help="one run: that density's, or keeping none")
    parser.add_argument("--debug", action="store_true", help="the newcomer logs at debug level (each read timed)")
    args = parser.parse_args(argv)
    results = []
    # the lab's updates, then none kept, then the default density's updates (4x the bytes)
    runs = {"1/16": (1 / 16, KEPT_ROUNDS), "none": (1 / 16, 0), "1/4": (1 / 4, KEPT_ROUNDS)}
    try:
        for name, (density, keep) in runs.items():
            if args.only is not None and name != args.only:
                continue
            with tempfile.TemporaryDirectory(prefix="slow-join-") as tmp:
                workdir = Path(tmp) if args.keep is None else args.keep / name.replace("/", "-")
                results.append(
                    run(
                        workdir,
                        debug=args.debug,
                        slow=args.slow,
                        fast=args.fast,
                        codec=args.codec,
                        density=density,
                        keep_updates=keep,
                        phase_s=args.phase_s,
                        deadline_s=args.deadline_s,
                    )
                )
    except NotRootError as exc:
        print(f"slow_join: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"slow-join-{stamp}.md").write_text(_markdown(results, args))
    rows = [{**asdict(r), "spans": r.spans, "bound_s": r.bound_s} for r in results]
    (args.out / f"slow-join-{stamp}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(_markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
