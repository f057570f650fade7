"""Relayed against direct members of one swarm, on the same links (the NAT lab).

    sudo python -m benchmarks.nat_paths [--rounds 8] [--rate 100mbit] [--direct 2] [--relayed 2]
        [--relay coordinator|volunteers] [--hole-punch on|off]
    sudo python -m benchmarks.nat_paths --topology mixed --peers 4 [--relay ...] [--hole-punch ...]

A coordinator on the public segment, ``--direct`` peers with public addresses and
``--relayed`` peers each behind its own NAT router (``benchmarks.netsim``), every host's link
shaped to ``--rate`` both ways, the demo spec for ``--rounds`` rounds, each round's group
waiting for every peer (``min_group_size``). ``--relay`` says who
relays: the coordinator (its direct peers run none: ``--relay-ports none``) or the direct peers
(volunteers' relays; the coordinator runs none). Per path it reports the rounds averaged, the
mean all-reduce time and bytes per round; and the share of the swarm's averaging traffic that
crossed a relay (the coordinator's ``swarmtrain_relay_bytes``, or the volunteers' "relay:
carried N bytes" lines, over the bytes every member sent and received). With ``--topology``
the hosts sit where a named topology puts them (``benchmarks.topologies``: home NAT, rented GPUs
with port mappings, datacenters, with their rates and delays) and each peer's path is the one
its ``network:`` line names. By default the peers run with ``--no-hole-punch``, so that the
relayed members' numbers are the relay's; with ``--hole-punch on`` they hole-punch direct
connections to relayed peers, as peers do by default (``peer.net.puncher``); the punched
connections and the bytes they carried come from the peers' lines at exit. Writes
``benchmarks/results/nat-paths-DATE[-TOPOLOGY][-volunteers][-punched].{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.netsim import NotRootError, WanSim
from benchmarks.topologies import PEER_PORT, TOPOLOGIES, Topology, lab, rtt_ms, topology

ROOT = Path(__file__).resolve().parents[1]
SW = [sys.executable, "-m", "swarmtrain"]


def _wait_for(log: Path, pattern: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if log.exists() and re.search(pattern, log.read_text(), re.MULTILINE):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{log} never printed {pattern!r}")


def _wait_for_relays(http: str, n: int, deadline_s: float = 120.0) -> None:
    """Until the coordinator's peers API shows ``n`` peers offering a relay."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{http}api/v1/peers", timeout=5) as response:
                if sum(1 for p in json.load(response) if p.get("relay")) >= n:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the coordinator never listed {n} volunteers' relays")


def run(
    rounds: int,
    rate: str,
    where: Topology,
    workdir: Path,
    d_model: int = 64,
    n_layers: int = 2,
    relay: str = "coordinator",
    hole_punch: bool = False,
) -> dict[str, Any]:
    peers = list(where.places)
    spec = workdir / "spec.toml"
    text = (ROOT / "examples" / "demo.toml").read_text().replace("max_rounds = 12", f"max_rounds = {rounds}")
    text = text.replace("d_model = 64", f"d_model = {d_model}").replace("n_layers = 2", f"n_layers = {n_layers}")
    # every round waits for every peer: the paths are compared in the same rounds, and no peer
    # joins a swarm already running (a join is a download of the state: another measurement)
    spec.write_text(text.replace("min_group_size = 2", f"min_group_size = {len(peers)}"))
    with WanSim(where.hosts, rate=rate, prefix="natb", subnet="10.79.9.0/24", **where.sim_kwargs()) as sim:
        host = sim.ip("coord")
        argv = [*SW, "coordinator", "--spec", str(spec), "--state-dir", str(workdir / "coordinator"), "--host", host]
        argv += ["--grpc-port", "7500", "--dht-port", "7600", "--http-port", "8080"]
        argv += ["--relay-ports", "none"] if relay == "volunteers" else []
        sim.run("coord", argv, stdout=(workdir / "coordinator.log").open("w"), stderr=subprocess.STDOUT)
        _wait_for(workdir / "coordinator.log", r"^peers join with:", 60)
        procs = {}
        # volunteers' relays first: a peer nobody can dial asks the relays its join answer lists
        volunteers = [name for name, place in where.places.items() if place == "datacenter"]
        first = volunteers if relay == "volunteers" else []
        for name in first + [name for name in peers if name not in first]:
            if first and name == next((n for n in peers if n not in first), None):
                _wait_for_relays(f"http://{host}:8080/", len(first))  # before the first of the others
            argv = [*SW, "peer", "--coordinator", f"{host}:7500", "--host", "0.0.0.0", "--port", str(PEER_PORT)]
            if name in where.announce_ports:
                argv += ["--announce", f"{sim.ip(name)}:{where.announce_ports[name]}"]
            argv += ["--key", str(workdir / f"{name}.key"), "--checkpoint-dir", str(workdir / f"{name}-ckpt")]
            argv += ["--metrics-file", str(workdir / f"{name}.jsonl")]
            argv += ["--relay-ports", "none"] if relay == "coordinator" else []
            argv += [] if hole_punch else ["--no-hole-punch"]
            log = (workdir / f"{name}.log").open("w")
            procs[name] = sim.run(name, argv, stdout=log, stderr=subprocess.STDOUT)
        relay_bytes = 0.0
        end = time.monotonic() + 60 * rounds + 120
        while time.monotonic() < end and any(p.poll() is None for p in procs.values()):
            try:
                with urllib.request.urlopen(f"http://{host}:8080/metrics", timeout=5) as response:
                    found = re.search(r"^swarmtrain_relay_bytes_total ([0-9.e+]+)$", response.read().decode(), re.M)
                relay_bytes = float(found.group(1)) if found else relay_bytes
            except OSError:
                pass
            time.sleep(2)
    if relay == "volunteers":
        relay_bytes = float(sum(_carried(workdir / f"{name}.log") for name in peers))
    paths = {name: _path(workdir / f"{name}.log") for name in peers}
    result = _summary(workdir, paths, relay_bytes, rounds, rate)
    result["model"] = {"d_model": d_model, "n_layers": n_layers}
    result["relay"] = relay
    result["topology"] = where.name
    result["places"] = where.places
    result["relayed_via"] = {name: _relayed_via(workdir / f"{name}.log") for name in peers if paths[name] == "relayed"}
    result["hole_punch"] = hole_punch
    punched = [_punched(workdir / f"{name}.log") for name in peers]
    result["punched_connections"] = sum(direct for direct, _ in punched)
    result["punched_bytes"] = sum(carried for _, carried in punched)
    return result


def _path(log: Path) -> str:
    """The path a peer's ``network:`` line names ("unknown" when it printed none)."""
    found = re.search(r"^network: (\w+)", log.read_text() if log.exists() else "", re.M)
    return found.group(1) if found else "unknown"


def _carried(log: Path) -> int:
    """The bytes a volunteer's relay carried, from its last line (0 when it ran none)."""
    found = re.findall(r"^relay: carried ([0-9,]+) bytes", log.read_text() if log.exists() else "", re.M)
    return int(found[-1].replace(",", "")) if found else 0


def _punched(log: Path) -> tuple[int, int]:
    """(direct connections this peer asked for and got, bytes carried directly both by those and
    by the punches it answered), from its lines at exit."""
    text = log.read_text() if log.exists() else ""
    asked = re.findall(r"^hole punch: asked \d+, (\d+) direct, .*\(carried ([0-9,]+) bytes directly\)$", text, re.M)
    answered = re.findall(r"^hole punch: answered \d+ \(carried ([0-9,]+) bytes directly\)$", text, re.M)
    direct = int(asked[-1][0]) if asked else 0
    carried = (int(asked[-1][1].replace(",", "")) if asked else 0) + (
        int(answered[-1].replace(",", "")) if answered else 0
    )
    return direct, carried


def _relayed_via(log: Path) -> str:
    """Whose relay a relayed peer's network line names ("" when it was not relayed)."""
    found = re.search(
        r"^network: relayed at .+? \(.*; a port on (.*)\)$", log.read_text() if log.exists() else "", re.M
    )
    return found.group(1) if found else ""


def _summary(workdir: Path, paths: dict[str, str], relay_bytes: float, rounds: int, rate: str) -> dict[str, Any]:
    by_path: dict[str, Any] = {}
    total_bytes = 0.0
    for path in sorted(set(paths.values())):
        names = [name for name, its in paths.items() if its == path]
        rows = []
        since_in = 0  # rounds from each peer's first averaged round to the last, summed
        for name in names:
            file = workdir / f"{name}.jsonl"
            its = [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
            firsts = [r["round"] for r in its if r["averaged"] and r["group_size"] >= 2]
            since_in += rounds - min(firsts) + 1 if firsts else 0
            rows += its
        done = [r for r in rows if r["averaged"] and r["group_size"] >= 2]
        total_bytes += sum(r["bytes_sent"] + r["bytes_received"] for r in done)
        by_path[path] = {
            "peers": len(names),
            "rounds_averaged": len({(r["round"]) for r in done}),
            "peer_rounds_averaged": len(done),
            "peer_rounds_since_in": since_in,
            "allreduce_s_mean": statistics.fmean(r["allreduce_s"] for r in done) if done else None,
            "bytes_per_round": statistics.fmean(r["bytes_sent"] + r["bytes_received"] for r in done) if done else None,
        }
    # the members' sent + received counts every averaging byte twice (its sender's and its
    # receiver's); the relay counts each byte it splices once (it crosses the relay's link twice)
    return {
        "rounds": rounds,
        "rate": rate,
        "paths": by_path,
        "relay_bytes": relay_bytes,
        "member_bytes": total_bytes,
        "relayed_share": relay_bytes / (total_bytes / 2) if total_bytes else None,
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Relayed and direct members of one swarm ({date.today()})",
        "",
        f"`sudo python -m benchmarks.nat_paths`: demo spec with d_model {result['model']['d_model']}, "
        f"{result['model']['n_layers']} layers, {result['rounds']} rounds, "
        + (
            f"every link {result['rate']} both ways (tbf, no added delay)"
            if result.get("topology", "lab") == "lab"
            else f"topology {result['topology']} ({_places(result['places'])})"
        )
        + ", a public coordinator; "
        + (
            "the direct peers relay (volunteers' relays), the coordinator runs none."
            if result.get("relay") == "volunteers"
            else "the coordinator relays, the direct peers run none."
        ),
        "",
        "| path | peers | peer-rounds averaged (of those since its first) | all-reduce s (mean) | bytes per member-round |",
        "|---|---|---|---|---|",
    ]
    for path, row in result["paths"].items():
        mean = f"{row['allreduce_s_mean']:.3f}" if row["allreduce_s_mean"] is not None else "-"
        per = f"{row['bytes_per_round']:,.0f}" if row["bytes_per_round"] is not None else "-"
        averaged = f"{row['peer_rounds_averaged']} (of {row.get('peer_rounds_since_in', '-')})"
        lines.append(f"| {path} | {row['peers']} | {averaged} | {mean} | {per} |")
    share = result["relayed_share"]
    lines += [
        "",
        f"The relay{'s' if result.get('relay') == 'volunteers' else ''} spliced {result['relay_bytes']:,.0f} bytes (each crosses its link twice; DHT and "
        f"matchmaking traffic included) against {result['member_bytes'] / 2:,.0f} averaging bytes on the wire "
        f"(half the members' sent + received): {share:.2%}."
        if share is not None
        else "No traffic measured.",
        "",
    ]
    if "hole_punch" in result:
        lines += [
            f"Hole punching {'on (the default)' if result['hole_punch'] else 'off (--no-hole-punch)'}: "
            f"{result['punched_connections']} punched connections, {result['punched_bytes']:,} bytes carried over "
            "them (counted at both ends: each byte twice).",
            "",
        ]
    via = {name: whose for name, whose in result.get("relayed_via", {}).items() if whose}
    if via:
        lines += ["Relayed through: " + "; ".join(f"{name}: {whose}" for name, whose in sorted(via.items())), ""]
    return "\n".join(lines)


def _places(places: dict[str, str]) -> str:
    """Where the peers sit, their links and RTTs (``benchmarks.topologies``)."""
    counts = {place: sum(1 for p in places.values() if p == place) for place in dict.fromkeys(places.values())}
    sites = ", ".join(f"{n} {place}" for place, n in counts.items())
    kinds = list(counts)
    rtts = sorted({rtt_ms(a, b) for a in kinds for b in kinds})  # type: ignore[arg-type]
    return f"peers: {sites}; RTTs between peers {rtts[0]:g}-{rtts[-1]:g} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nat_paths", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--direct", type=int, default=2)
    parser.add_argument("--relayed", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--relay", choices=("coordinator", "volunteers"), default="coordinator")
    parser.add_argument(
        "--topology", choices=sorted(TOPOLOGIES), default=None, help="a named topology instead of --direct/--relayed"
    )
    parser.add_argument("--peers", type=int, default=4, help="peers of --topology")
    parser.add_argument(
        "--hole-punch",
        choices=("on", "off"),
        default="off",
        help="on: peers hole-punch to relayed peers (a peer's default); off: relays only (--no-hole-punch)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/swarmtrain-nat-paths"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        where = topology(args.topology, args.peers) if args.topology else lab(args.direct, args.relayed)
        punch = args.hole_punch == "on"
        result = run(args.rounds, args.rate, where, args.workdir, args.d_model, args.n_layers, args.relay, punch)
    except NotRootError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    suffix = (f"-{args.topology}" if args.topology else "") + ("-volunteers" if args.relay == "volunteers" else "")
    suffix += "-punched" if args.hole_punch == "on" else ""
    stem = args.out / f"nat-paths-{date.today()}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
