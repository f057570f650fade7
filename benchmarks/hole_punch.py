"""Can two peers, each behind its own NAT, open a TCP connection to each other? (the NAT lab)

    sudo python -m benchmarks.hole_punch [--tries 10] [--delay-ms 0] [--out benchmarks/results]

The simultaneous open alone, without a swarm (``peer.net.hole_punch`` makes it through a relay, and
``benchmarks.nat_paths --hole-punch on`` measures the swarm over it): a rendezvous on the public
segment (where a relay would be) sees the address each peer's connection comes from; each peer
then connects to the other's observed address from the same local port at the same moment
(a TCP simultaneous open), retrying for a few seconds. Each try is a fresh pair of NAT'ed
hosts (``benchmarks.netsim``, nftables masquerade routers: ``benchmarks.nat_router``). Writes
``hole-punch-DATE-rttMS.{md,json}``: how many tries connected both ways, and how long it took.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks.netsim import Nat, NotRootError, WanSim

RENDEZVOUS_PORT = 7900
LOCAL_PORT = 7790
PUNCH_S = 6.0


def rendezvous(host: str) -> None:
    """Accept two peers; tell each where the other's connection came from."""
    server = socket.create_server((host, RENDEZVOUS_PORT))
    conns = [server.accept() for _ in range(2)]
    for (conn, _), (_, other) in zip(conns, reversed(conns)):
        conn.sendall(f"{other[0]} {other[1]}\n".encode())
        conn.close()


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", LOCAL_PORT))
    return sock


def punch(rendezvous_host: str) -> None:
    """Learn the other peer's observed address, then connect to it from the same local port
    until it answers or ``PUNCH_S`` pass; print one JSON line."""
    sock = _bound()
    sock.connect((rendezvous_host, RENDEZVOUS_PORT))
    host, port = sock.makefile().readline().split()
    sock.close()
    started = time.monotonic()
    result: dict[str, object] = {"peer": f"{host}:{port}", "connected": False}
    while time.monotonic() - started < PUNCH_S:
        attempt = _bound()
        attempt.settimeout(1.0)
        try:
            attempt.connect((host, int(port)))
            attempt.sendall(b"hello")
            result |= {"connected": attempt.recv(5) == b"hello", "after_s": round(time.monotonic() - started, 3)}
            break
        except OSError as exc:
            result["error"] = str(exc)
            time.sleep(0.05)
        finally:
            attempt.close()
    print(json.dumps(result), flush=True)


def one_try(delay_ms: float) -> list[dict[str, object]]:
    with WanSim(
        ["rdv", "a", "b"],
        rate="100mbit",
        prefix="punch",
        subnet="10.79.8.0/24",
        nat={"a": Nat(), "b": Nat()},
        delay_ms=delay_ms,
    ) as sim:
        rdv = sim.ip("rdv")
        server = sim.run("rdv", [sys.executable, "-m", "benchmarks.hole_punch", "--rendezvous", rdv])
        time.sleep(0.5)
        peers = [
            sim.run(
                h, [sys.executable, "-m", "benchmarks.hole_punch", "--punch", rdv], stdout=subprocess.PIPE, text=True
            )
            for h in ("a", "b")
        ]
        out = [json.loads(p.communicate(timeout=30)[0] or "{}") for p in peers]
        server.wait(timeout=10)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hole_punch", description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on each host's link")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--rendezvous", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--punch", metavar="RENDEZVOUS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rendezvous:
        rendezvous(args.rendezvous)
        return 0
    if args.punch:
        punch(args.punch)
        return 0
    results = []
    try:
        for _ in range(args.tries):
            results.append(one_try(args.delay_ms))
    except NotRootError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    both = sum(1 for pair in results if all(r.get("connected") for r in pair))
    summary = {"tries": args.tries, "delay_ms": args.delay_ms, "both_connected": both, "results": results}
    times = [float(r["after_s"]) for pair in results for r in pair if r.get("connected")]  # type: ignore[arg-type]
    rtt = 4 * args.delay_ms
    stem = args.out / f"hole-punch-{date.today()}-rtt{rtt:g}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    text = (
        f"# Hole punching between two NAT'ed hosts ({date.today()})\n\n"
        f"`sudo python -m benchmarks.hole_punch --tries {args.tries} --delay-ms {args.delay_ms:g}`: two hosts, each "
        f"behind its own nftables masquerade router, a rendezvous on the public segment, {rtt:g} ms RTT between "
        "the hosts; each connects to the other's observed address from the same local port (TCP simultaneous "
        f"open), retrying for {PUNCH_S:g} s.\n\n"
        f"Connected both ways in **{both} of {args.tries}** tries"
        + (f"; after {statistics.median(times):.3f} s median, {max(times):.3f} s at most.\n" if times else ".\n")
    )
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
