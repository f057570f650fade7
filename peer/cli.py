"""``swarmtrain peer``: run a training peer.

Standalone (no coordinator): ``swarmtrain peer --spec run.toml`` starts a swarm and prints
its multiaddrs; others join with ``--initial-peers MADDR``. Heavy imports (torch, hivemind)
happen only after the arguments parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.bulk_settings import BulkSettings
from engine.update_store import KEPT_ROUNDS
from peer.net.announce import coordinator_address, parse_host_port
from peer.node.node_identity import NodeIdentity
from peer.round.progress import ProgressDisplay
from peer.round.round_metrics import RoundMetrics
from protocol.errors import AdmissionError, ConfigError

if TYPE_CHECKING:
    from peer.boot.plan import Plan
    from peer.link.coordinator_link import CoordinatorLink
    from peer.net.network_path import NetworkPath
    from peer.net.relay_service import RelayOffer
    from peer.swarm.swarm import Swarm
    from peer.task import Task
    from protocol.identity import Identity
    from protocol.spec import RunSpec

logger = logging.getLogger(__name__)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "peer",
        help="run a training peer (join a run through a coordinator or peers)",
        description="Run a training peer. With --coordinator it joins that coordinator's run (the usual "
        "way); with --spec and --initial-peers it joins the peers at those multiaddrs; with --spec alone it "
        "starts a swarm of its own and prints the multiaddrs others join with.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output (-vv: debug)"
    )
    parser.add_argument("--spec", type=Path, help="run spec (TOML)")
    parser.add_argument(
        "--coordinator",
        type=coordinator_address,
        metavar="HOST:PORT",
        help="join the run of the coordinator at HOST:PORT (its gRPC port, 7500 by default)",
    )
    parser.add_argument(
        "--coordinator-key",
        metavar="ID",
        help="the coordinator's public id (it prints it at start): its join answers must be signed with it "
        "(default: the key first met at HOST:PORT, pinned in --checkpoint-dir)",
    )
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs of running peers")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    parser.add_argument(
        "--bulk-port",
        default="0",
        metavar="PORT[:PUBLIC]|off",
        help="receive the averaging parts over TLS connections of their own beside --port, on PORT (default 0: "
        "any free port; PORT:PUBLIC where a mapping forwards PUBLIC to PORT; behind a firewall that forwards "
        "only chosen ports, forward one more and give it here), and trade them so with members that listen; "
        "parts to and from a member without a direct path go over libp2p. off: libp2p only. 96-98%% of plain "
        "TCP on 5 and 50 Mbit/s links where libp2p reaches 92-96%% (docs/benchmarks.md)",
    )
    parser.add_argument(
        "--announce",
        default=None,
        metavar="HOST:PORT",
        help="the public address others dial this peer at, when it differs from where it listens (a "
        "rented GPU's or a router's port mapping: external port != --port); default: from vast.ai's or "
        "RunPod's variables when they map --port, else the addresses this machine sees",
    )
    parser.add_argument(
        "--client-mode",
        action="store_true",
        help="never be dialled: no relay, no hole punching; the peer only dials out and averages without "
        "reducing (a peer behind NAT needs no flag: it is relayed and hole-punched by default)",
    )
    parser.add_argument(
        "--relay-ports",
        default="auto",
        metavar="FIRST-LAST",
        help="when the coordinator reaches this peer, relay for peers nobody can dial: FIRST is the relay's "
        "port, the others are granted, one per relayed peer (default auto: any free ports, 8 peers at most, "
        "where the coordinator reaches a port the system picks); 'none': no relay",
    )
    parser.add_argument(
        "--hole-punch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hole-punch direct connections to the relayed peers this one dials at a relay, and answer their "
        "punches, so that averaging traffic skips the relay (default: on; --no-hole-punch: relayed paths only)",
    )
    parser.add_argument(
        "--key",
        type=Path,
        default=None,
        help="your account key file (created if absent); each running peer signs with its own node key, "
        "endorsed by it, so one key may run many peers",
    )
    parser.add_argument("--metrics-file", type=Path, default=None, help="append one JSON object per round here")
    parser.add_argument(
        "--log-to",
        action="append",
        default=[],
        metavar="KIND:WHERE",
        help="also log each round's figures to tensorboard:DIR or wandb:PROJECT (offline unless "
        "WANDB_MODE/WANDB_API_KEY say otherwise); repeatable",
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="save checkpoints here; resume from them")
    parser.add_argument("--checkpoint-every", type=int, default=1, help="rounds between checkpoints (default: 1)")
    parser.add_argument(
        "--keep-updates",
        type=int,
        default=KEPT_ROUNDS,
        metavar="ROUNDS",
        help="keep the averaged updates of the last ROUNDS rounds on disk (under --checkpoint-dir, else a "
        "temporary directory) for newcomers whose state download outlasted them "
        f"(default: {KEPT_ROUNDS}; 0: keep none)",
    )
    parser.add_argument(
        "--wait-for-group",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before the first round, wait up to this long for the spec's min_group_size peers (default: 60)",
    )
    parser.add_argument("--max-rounds", type=int, default=None, help="stop after this many rounds")
    parser.add_argument(
        "--leave-after-failures",
        type=int,
        default=0,
        metavar="N",
        help="leave cleanly (exit status 1) after N failed rounds in a row, for a supervisor to restart the peer "
        "(default 0: never; the peer says why every few failed rounds either way)",
    )
    parser.add_argument("--shard-seed", type=int, default=None, help="data shard seed (default: from the key)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="token runs: where this machine keeps the run's prepared data (default: the spec's data.path, or "
        "for a run that publishes its data, a folder of the run under ~/.cache/swarmtrain/data)",
    )
    parser.add_argument(
        "--data-cap",
        type=float,
        default=None,
        metavar="GB",
        help="token runs that publish their data: keep at most GB of fetched shards on disk (default: no cap)",
    )
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="continued pretraining: where this machine keeps the run's weights (default: the spec's weights_path)",
    )
    parser.add_argument(
        "--data-slot",
        type=int,
        default=None,
        metavar="N",
        help="token runs without a coordinator: the data stream this peer trains (the coordinator hands them out)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--rank-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with several local ranks, a rank silent this long is hung and ends the node (default: 120)",
    )
    parser.add_argument(
        "--fsdp",
        choices=("auto", "on", "off"),
        default="auto",
        help="with several local ranks, shard the model over them with FSDP2 (default auto: when the "
        "training state does not fit one GPU; never on CPU)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="local ranks (GPUs) of this node, one member of the swarm (default: every visible GPU; 1 on CPU)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="N",
        help="causal_lm runs: split each inner step's batch into N micro-batches on this peer (default: the "
        "run's; must divide inner.batch_size). Fewer: faster, more GPU memory; the step is the same",
    )
    parser.add_argument(
        "--activation-checkpointing",
        choices=("on", "off"),
        default=None,
        help="causal_lm runs: recompute activations in the backward on this peer (default: the run's). "
        "off: ~25%% faster, much more GPU memory (`swarmtrain doctor --spec` says what fits)",
    )
    parser.add_argument(
        "--compile",
        choices=("on", "off"),
        default=None,
        help="causal_lm runs: torch.compile each decoder block on this peer (default: the run's); "
        "the first steps compile, the rest run faster on a GPU",
    )
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument("--overlap", dest="overlap", action="store_true", default=None, help="force overlap on")
    overlap.add_argument("--no-overlap", dest="overlap", action="store_false", help="force overlap off")
    parser.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags with one ``ConfigError``, before anything is imported or written."""
    if args.spec is None and not args.coordinator:
        raise ConfigError("--spec FILE or --coordinator HOST:PORT is required")
    if args.max_rounds is not None and args.max_rounds < 1:
        raise ConfigError(f"--max-rounds must be >= 1, got {args.max_rounds}")
    if args.data_cap is not None and not 0.001 <= args.data_cap <= 1e6:
        raise ConfigError(f"--data-cap must be between 0.001 and 1000000 GB, got {args.data_cap:g}")
    if not 0 <= args.leave_after_failures <= 1_000_000:
        raise ConfigError(
            f"--leave-after-failures must be between 0 (never) and 1000000, got {args.leave_after_failures}"
        )
    if not 0 <= args.wait_for_group < 86400:
        raise ConfigError(f"--wait-for-group must be between 0 and 86400 seconds, got {args.wait_for_group}")
    if args.micro_batches is not None and not 1 <= args.micro_batches <= 1024:
        raise ConfigError(f"--micro-batches must be in 1..1024, got {args.micro_batches}")
    if not 0 <= args.keep_updates <= 1000:
        raise ConfigError(f"--keep-updates must be between 0 (none) and 1000 rounds, got {args.keep_updates}")
    if args.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    try:
        BulkSettings.parse(args.bulk_port)
    except ValueError as exc:
        raise ConfigError(f"--bulk-port: {exc}") from None
    if args.announce is not None:
        parse_host_port(args.announce)
        if args.port == 0:
            raise ConfigError("--announce needs --port: the port its mapping forwards to, where this peer listens")
        if args.client_mode:
            raise ConfigError("--announce is for peers others dial; a --client-mode peer is never dialled")
    if args.nproc_per_node is not None and not 1 <= args.nproc_per_node <= 64:
        raise ConfigError(f"--nproc-per-node must be in 1..64, got {args.nproc_per_node}")
    from peer.net.relay_service import relay_ports

    ports, _ = relay_ports(args.relay_ports)
    if ports is not None and args.port and args.port in ports:
        raise ConfigError(f"--relay-ports {args.relay_ports} includes --port {args.port}")
    from protocol.experiment_log import parse_target

    for target in args.log_to:
        parse_target(target)
    if args.data_slot is not None and not 0 <= args.data_slot < 65536:
        raise ConfigError(f"--data-slot must be in 0..65535, got {args.data_slot}")
    if args.data_slot is not None and args.coordinator:
        raise ConfigError("--data-slot is for runs without a coordinator (the coordinator hands out data streams)")
    if not 5 <= args.rank_timeout <= 86400:
        raise ConfigError(f"--rank-timeout must be between 5 and 86400 seconds, got {args.rank_timeout}")


def ranks_to_launch(args: argparse.Namespace) -> int | None:
    """How many local ranks the launcher must start for this command, or None when this
    process runs the peer itself: it already is a rank (started by the launcher or by
    torchrun), or the node has one GPU (or none) and ``--nproc-per-node`` is not given. An
    explicit ``--nproc-per-node N`` always makes a node of N ranks, one included (torch.distributed
    and, with ``--fsdp on``, FSDP2 over a single GPU)."""
    check_args(args)
    from peer.node.node_env import NodeEnv

    node_env = NodeEnv.from_environ()
    if node_env is not None:
        if args.nproc_per_node not in (None, node_env.world_size):
            raise ConfigError(
                f"--nproc-per-node {args.nproc_per_node}, but torch.distributed says {node_env.world_size} local ranks"
            )
        return None
    if args.nproc_per_node is not None:
        return int(args.nproc_per_node)
    if args.device not in (None, "cuda"):
        return None
    import torch

    count = torch.cuda.device_count()
    return count if count > 1 else None


def run(args: argparse.Namespace) -> int:
    """``swarmtrain peer`` as the leader (or only rank) of its node, in named steps; a node's
    other local ranks run ``run_worker_rank``."""
    check_args(args)
    from protocol.tmpdir import check_tmpdir

    check_tmpdir()  # hivemind's averager shares tensors through torch's socket there
    from peer.node.node_env import NodeEnv

    node_env = NodeEnv.from_environ()
    if node_env is not None and node_env.rank > 0:
        from peer.boot.worker import run_worker_rank

        return run_worker_rank(args, node_env)
    # from here on a signal means "leave cleanly": a SIGTERM while torch imports or the DHT
    # starts must not kill the process with its hivemind children running
    stop = threading.Event()
    _install_signal_handlers(stop)
    from peer.boot.join import checked_compute, identities, join_run

    node, created, _checkpoint_lock = identities(args)  # the lock is held while the peer runs
    joined = join_run(args, node, node_env, stop)
    compute = checked_compute(args, joined)
    # the rest loads torch and hivemind: after the join, whose lines (a coordinator that is
    # down, a refusal) come at once
    from peer.boot.network import (
        link_to_coordinator,
        member_gate,
        network_path,
        relay_offer,
        say_punched,
        start_puncher,
        start_relay_keeper,
    )
    from peer.boot.plan import build_peer_task, plan_node, start_swarm
    from relay.splicer import Splicer, share

    plan = plan_node(args, joined, compute, node, node_env)
    splicer = Splicer()  # relay tunnels, punched connections and this peer's relay splice there
    share(splicer)
    path = network_path(args, joined)
    relay = None
    gate = member_gate(joined)
    try:
        relay = relay_offer(args, joined, path, gate)
        swarm = start_swarm(args, joined, plan, path, gate, node.node, stop)
    except BaseException:
        path.close()
        if relay is not None:
            relay.close()
        share(None)
        splicer.close()
        raise
    link = None
    puncher = None
    keeper = None
    try:
        task = plan.task or build_peer_task(args, joined, compute, plan.shard_seed, plan.model_device)
        built = sum(p.numel() for p in task.model.parameters())
        if built != plan.numel:
            raise ConfigError(f"the task's model has {built} parameters, its spec says {plan.numel}")
        _announce(joined.spec.run.name, node, created, swarm, args, plan, node_env, path, relay)
        puncher = start_puncher(args, joined, swarm, path)
        link = link_to_coordinator(args, joined, swarm, stop, path, relay, puncher)
        keeper = start_relay_keeper(args, joined, swarm, path, link, puncher)
        _train(args, joined.spec, task, swarm, plan, link, node.node, stop)
        if link is not None and link.refused:
            raise AdmissionError(f"the coordinator refused this peer: {link.refused}")
    finally:
        if keeper is not None:
            keeper.close()
        if link is not None:
            link.stop()
        if puncher is not None:
            puncher.close()
            print(f"hole punch: {puncher.describe()}", flush=True)
        swarm.shutdown()
        if args.hole_punch:
            say_punched(path)
        path.close()
        if relay is not None:
            carried = relay.stats()
            relay.close()
            if carried is not None:
                print(f"relay: carried {carried.bytes_relayed:,} bytes for peers nobody can dial", flush=True)
        if plan.local_node is not None:
            plan.local_node.close()
        share(None)
        splicer.close()
    if link is not None and link.credit is not None:
        print(f"coordinator: {link.credit.describe()}", flush=True)
    print("peer stopped cleanly", flush=True)
    _hold_late_signals()
    return 0


def _train(
    args: argparse.Namespace,
    spec: RunSpec,
    task: Task,
    swarm: Swarm,
    plan: Plan,
    link: CoordinatorLink | None,
    identity: Identity,
    stop: threading.Event,
) -> None:
    """Run the trainer until done or told to leave; each round goes to the progress line, the
    metrics file, the experiment log and the coordinator."""
    from peer.node.node import Command
    from peer.round.trainer import Trainer, TrainerOptions
    from peer.round.watchdog import Watchdog, WatchdogLeave
    from protocol.experiment_log import ExperimentLog, peer_figures

    options = TrainerOptions(
        identity=identity,
        max_rounds=args.max_rounds,
        device=plan.device,
        overlap=args.overlap,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        wait_for_group_s=args.wait_for_group,
        stop=stop,
        node=plan.local_node,
        shard=plan.shard,
    )
    display = ProgressDisplay(credit=lambda: link.credit if link is not None else None)
    display.guard_logging()
    report = _reporter(args.metrics_file, display)
    experiment = ExperimentLog(args.log_to, name=f"{spec.run.name}-{identity.public_key.id[8:20]}")
    watchdog = Watchdog(say=display.say, leave=lambda reason: stop.set(), leave_after=args.leave_after_failures)

    def on_round(metrics: RoundMetrics) -> None:
        if link is not None:  # on disk before the row says the round averaged (a kill between the two)
            link.report(metrics)
        row = metrics.as_dict()
        report(row)
        experiment.scalars(metrics.round, peer_figures(row))
        watchdog.on_round(metrics)

    trainer = Trainer(spec, task, swarm, options, on_round=on_round, progress=display, journal=link)
    if link is not None:
        link.phase_of = lambda: trainer.phase.value  # heartbeats say when it waits for its group
    try:
        trainer.run()
        if watchdog.reason:
            raise WatchdogLeave(watchdog.reason)
        if trainer.missed_end is not None:
            print(
                f"the run ended at round {trainer.missed_end} without this peer (it missed the last round)", flush=True
            )
    finally:
        experiment.close()
        display.clear()
        if plan.local_node is not None:
            with contextlib.suppress(Exception):  # a lost rank: the launcher names it
                plan.local_node.send(Command.STOP)


def _announce(
    run_name: str,
    node: NodeIdentity,
    created: bool,
    swarm: Any,
    args: argparse.Namespace,
    plan: Plan,
    node_env: Any = None,
    path: NetworkPath | None = None,
    relay: RelayOffer | None = None,
) -> None:
    mode = (
        "client mode (no inbound connections: --client-mode)"
        if args.client_mode
        else "reachable (accepts inbound connections)"
    )
    account = f"{node.account.public_key.id}{' (new identity)' if created else ''}"
    print(f"peer {node.node.public_key.id} of account {account} joining run {run_name!r}", flush=True)
    ranks = f" x {node_env.world_size} local ranks" if node_env is not None else ""
    ranks += " (FSDP2 shards)" if plan.shard else ""
    print(f"model: {plan.numel:,} parameters on {plan.device}{ranks}; {mode}", flush=True)
    from engine.compression import KERNELS_ENV, compiled_kernels  # torch: not at the CLI's import

    path_name = "compiled kernels" if compiled_kernels() is not None else "the torch reference"
    print(f"codecs and host passes: {path_name} ({KERNELS_ENV}: on, off or auto)", flush=True)
    own = [f"{args.micro_batches} micro-batches"] if args.micro_batches is not None else []
    own += [f"activation checkpointing {args.activation_checkpointing}"] if args.activation_checkpointing else []
    own += [f"compile {args.compile}"] if args.compile else []
    if own:
        print(f"this peer computes with {' and '.join(own)} (the run's step, its own memory and speed)", flush=True)
    for announce in path.announced if path is not None else ():
        print(f"announcing: {announce.maddr} (from {announce.source}; listening on port {args.port})", flush=True)
    if path is not None:
        print(f"network: {path.describe()}", flush=True)
    if relay is not None:
        print(f"relay: {relay.describe()}", flush=True)
    for maddr in swarm.visible_maddrs:
        print(f"listening: {maddr}", flush=True)
    if not args.initial_peers:
        print("started a new swarm; others join with --initial-peers " + " ".join(swarm.visible_maddrs), flush=True)


def _reporter(metrics_file: Path | None, display: ProgressDisplay) -> Any:
    def report(metrics: dict[str, Any]) -> None:
        display.round_done(metrics)
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            with metrics_file.open("a") as out:
                out.write(json.dumps(metrics, sort_keys=True) + "\n")

    return report


def _hold_late_signals() -> None:
    """Everything is shut down: a SIGINT/SIGTERM arriving now (while the interpreter exits and
    has already put the default handlers back) stays pending instead of turning exit status 0
    into death by signal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    # the mask holds only for this thread; a signal delivered to another one is ignored
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _tell(message: str) -> None:
    """A line on stderr that must not fail: a closed pipe (the starter died) is ignored. On a
    terminal it starts on a line of its own (the progress line may be showing)."""
    with contextlib.suppress(OSError, ValueError):
        print(("\n" if sys.stderr.isatty() else "") + message, file=sys.stderr, flush=True)


def _install_signal_handlers(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: leave after the current round; second: exit at once (130).

    Processes forked from this one (hivemind's DHT and averager) inherit the handler; there a
    signal does what it would have done without it, so ``terminate()`` still ends them (the
    averager's process ignores SIGINT itself: ``engine.process_signals``).
    """
    owner = os.getpid()

    def handle(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stop.is_set():
            _tell("second interrupt: exiting now")
            raise SystemExit(130)
        stop.set()  # first: the message may fail (its reader, e.g. the starter, may be gone)
        _tell("leaving after the current round (interrupt again to exit now)")

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
