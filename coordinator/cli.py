"""``swarmtrain coordinator --spec FILE``: run a coordinator until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import math
import signal
import threading
from pathlib import Path
from typing import Any

from coordinator.ratelimit import DEFAULT_BURST, DEFAULT_RATE
from protocol.errors import ConfigError


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "coordinator",
        help="run a coordinator: admission, health, credits, dashboard",
        description="Run a coordinator for the run in --spec: a DHT bootstrap peer and the gRPC API.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output")
    parser.add_argument("--spec", type=Path, required=True, help="run spec (TOML)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("coordinator-state"),
        help="keys, SQLite database, archive and model export (default: ./coordinator-state)",
    )
    parser.add_argument(
        "--db", default=None, metavar="URL", help="SQLAlchemy database URL (default: SQLite in --state-dir)"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0, every interface)")
    parser.add_argument("--grpc-port", type=int, default=7500, help="gRPC API port (default: 7500; 0: any free port)")
    parser.add_argument("--dht-port", type=int, default=0, help="DHT port (default: 0, any free port)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="dashboard, JSON API, /metrics (default: 8080; 0: any free port)",
    )
    parser.add_argument(
        "--relay-port",
        type=int,
        default=7800,
        help="relay for peers nobody can dial: its port (default: 7800; 0: any free port)",
    )
    parser.add_argument(
        "--relay-ports",
        default="7801-7864",
        metavar="FIRST-LAST",
        help="ports the relay grants, one per relayed peer (default: 7801-7864); 'none': no relay",
    )
    parser.add_argument(
        "--heartbeat-processes",
        type=int,
        default=1,
        metavar="N",
        help="processes that take the peers' heartbeats, beside the one that runs the rest "
        "(0: the gRPC port takes them; default: 1; a swarm of thousands wants a core each)",
    )
    parser.add_argument(
        "--heartbeat-port",
        type=int,
        default=0,
        help="their port, told to peers when they join (default: 0, any free port; a peer that "
        "cannot reach it heartbeats to the gRPC port)",
    )
    parser.add_argument(
        "--archive-every",
        type=int,
        default=10,
        metavar="K",
        help="fetch, verify and keep the swarm's state every K rounds (0: no archive; default: 10)",
    )
    parser.add_argument(
        "--archive-keep", type=int, default=3, metavar="N", help="archived checkpoints kept on disk (default: 3)"
    )
    parser.add_argument(
        "--operator",
        action="append",
        default=[],
        metavar="ID",
        help="public id of a key that may run `swarmtrain admin` (repeatable; default: none, the coordinator's own key "
        "always may)",
    )
    parser.add_argument(
        "--max-requests-per-source",
        type=float,
        default=DEFAULT_RATE,
        metavar="RATE",
        help=f"gRPC requests per second from one source address, bursts of {DEFAULT_BURST:g} "
        f"(0: no limit; default: {DEFAULT_RATE:g})",
    )
    parser.add_argument(
        "--log-to",
        action="append",
        default=[],
        metavar="KIND:WHERE",
        help="also log the swarm's figures per round to tensorboard:DIR or wandb:PROJECT; repeatable (default: none)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from protocol.tmpdir import check_tmpdir

    check_tmpdir()  # the archive averager shares tensors through torch's socket there
    from relay.server import parse_port_range

    relay_ports = parse_port_range(args.relay_ports)
    for name in ("grpc_port", "dht_port", "http_port", "relay_port", "heartbeat_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be in 0..65535, got {getattr(args, name)}")
    if not 0 <= args.heartbeat_processes <= 64:
        raise ConfigError(f"--heartbeat-processes must be in 0..64, got {args.heartbeat_processes}")
    if args.archive_every < 0:
        raise ConfigError(f"--archive-every must be >= 0, got {args.archive_every}")
    if args.archive_keep < 1:
        raise ConfigError(f"--archive-keep must be >= 1, got {args.archive_keep}")
    if not (math.isfinite(args.max_requests_per_source) and args.max_requests_per_source >= 0):
        raise ConfigError(f"--max-requests-per-source must be a number >= 0, got {args.max_requests_per_source}")
    from protocol.identity import PublicKey
    from protocol.spec import load_spec

    for operator in args.operator:
        try:
            PublicKey.from_id(operator)
        except Exception as exc:
            raise ConfigError(f"--operator {operator!r} is not a public id ({exc})") from exc

    from protocol.experiment_log import parse_target

    for target in args.log_to:
        parse_target(target)
    load_spec(args.spec)  # fail with the spec's own errors before starting anything
    for flag, port in (
        ("--grpc-port", args.grpc_port),
        ("--http-port", args.http_port),
        ("--relay-port", args.relay_port),
        ("--heartbeat-port", args.heartbeat_port),
    ):
        if flag == "--relay-port" and relay_ports is None:
            continue
        check_port_free(args.host, port, flag)
    from coordinator.server import CoordinatorServer, ServerConfig

    server = CoordinatorServer(
        ServerConfig(
            spec_path=args.spec,
            state_dir=args.state_dir,
            db_url=args.db,
            host=args.host,
            grpc_port=args.grpc_port,
            dht_port=args.dht_port,
            http_port=args.http_port,
            archive_every=args.archive_every,
            archive_keep=args.archive_keep,
            max_requests_per_source=args.max_requests_per_source,
            operators=tuple(args.operator),
            log_to=tuple(args.log_to),
            relay_port=args.relay_port,
            relay_ports=relay_ports,
            heartbeat_processes=args.heartbeat_processes,
            heartbeat_port=args.heartbeat_port,
        )
    )
    server.start()
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    print(f"coordinator of run {server.core.spec.run.name!r} ({server.core.digest})", flush=True)
    print(f"grpc: {host}:{server.grpc_port}", flush=True)
    if server.fronts is not None:
        print(f"heartbeats: {host}:{server.fronts.port} ({server.fronts.count} process(es))", flush=True)
    print(f"http: http://{host}:{server.http_port}/  (dashboard; /api/v1/status, /metrics)", flush=True)
    for maddr in server.maddrs:
        print(f"dht: {maddr}", flush=True)
    archive = (
        server.archive_off
        or f"every {args.archive_every} rounds, last {args.archive_keep} kept in {args.state_dir / 'archive'}"
    )
    print(f"archive: {archive}", flush=True)
    relay = (
        f"port {server.core.relay_port}, granting {relay_ports[0]}-{relay_ports[-1]} to peers nobody can dial"
        if relay_ports is not None
        else "off (--relay-ports none): peers nobody can dial average as clients"
    )
    print(f"relay: {relay}", flush=True)
    print(f"key: {server.core.identity.public_key.id}", flush=True)
    print(
        f"peers join with: swarmtrain peer --coordinator {host}:{server.grpc_port} "
        f"--coordinator-key {server.core.identity.public_key.id}",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()
    print("coordinator stopped", flush=True)
    return 0


def check_port_free(host: str, port: int, flag: str) -> None:
    """ConfigError, before anything starts, if ``port`` on ``host`` is taken (another coordinator,
    most likely): the servers bind without SO_REUSEPORT, so they would fail later, after the DHT
    and the archive averager started, and gRPC's default would even share the port silently."""
    if port == 0:
        return
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror}): another coordinator may be running there; stop it "
                f"or choose another {flag}"
            ) from exc
