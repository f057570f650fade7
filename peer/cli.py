"""``swarmtrain peer``: run a training peer.

Standalone (no coordinator): ``swarmtrain peer --spec run.toml`` starts a swarm and prints
its multiaddrs; others join with ``--initial-peers MADDR``. Heavy imports (torch, hivemind)
happen only after the arguments parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.update_store import KEPT_ROUNDS
from peer.net.announce import coordinator_address, parse_host_port
from peer.node.node_identity import NodeIdentity, node_identity
from peer.round.progress import ProgressDisplay
from peer.round.round_metrics import RoundMetrics
from protocol.errors import AdmissionError, ConfigError, IdentityError
from protocol.identity import PublicKey

if TYPE_CHECKING:
    from peer.link.coordinator_client import CoordinatorClient, JoinInfo
    from peer.link.coordinator_link import CoordinatorLink
    from peer.net.network_path import NetworkPath
    from peer.net.puncher import Puncher
    from peer.net.relay_keeper import RelayKeeper
    from peer.net.relay_service import RelayOffer
    from peer.node.node import LocalNode
    from peer.node.node_env import NodeEnv
    from peer.swarm.swarm import Swarm
    from peer.task import Task
    from protocol.identity import Identity
    from protocol.membership import MemberGate
    from protocol.spec import RunSpec

logger = logging.getLogger(__name__)

BOOTSTRAP_WAIT_S = 600.0
"""How long a peer keeps starting its DHT node while none of its bootstrap peers answers (a
coordinator restarting between this peer's join and its DHT's start: ``engine.dht_start``)."""


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


@dataclass
class _Joined:
    """What joining gave this peer: the run's spec and, through a coordinator, the client, the
    join's answer and the data stream it was given."""

    spec: RunSpec
    slot: int | None
    client: CoordinatorClient | None = None
    info: JoinInfo | None = None

    def leave(self) -> None:
        """Give back what the join took (the data stream) when the peer stops before training."""
        if self.client is not None:
            self.client.leave()


@dataclass
class _Plan:
    """How this node trains: on which device, over which local ranks, a model of what size."""

    device: str
    """This process's torch device."""
    local_node: LocalNode | None
    numel: int
    shard: bool
    """FSDP2 shards over the local ranks: the leader keeps a plain full copy of the model in
    host memory for the round's host passes, the ranks train shards of it on their devices."""
    shard_seed: int
    task: Task | None
    """Built already when the spec alone does not say the model's size."""

    @property
    def model_device(self) -> str:
        return "cpu" if self.shard else self.device


def run(args: argparse.Namespace) -> int:
    """``swarmtrain peer`` as the leader (or only rank) of its node, in named steps; a node's
    other local ranks run ``_run_worker``."""
    check_args(args)
    from protocol.tmpdir import check_tmpdir

    check_tmpdir()  # hivemind's averager shares tensors through torch's socket there
    from peer.node.node_env import NodeEnv

    node_env = NodeEnv.from_environ()
    if node_env is not None and node_env.rank > 0:
        return _run_worker(args, node_env)
    # from here on a signal means "leave cleanly": a SIGTERM while torch imports or the DHT
    # starts must not kill the process with its hivemind children running
    stop = threading.Event()
    _install_signal_handlers(stop)
    node, created, _checkpoint_lock = _identities(args)  # the lock is held while the peer runs
    joined = _join(args, node, node_env, stop)
    compute = _checked_compute(args, joined)
    plan = _plan(args, joined, compute, node, node_env)
    path = _network_path(args, joined)
    relay = None
    gate = _member_gate(joined)
    try:
        relay = _relay_offer(args, joined, path, gate)
        swarm = _start_swarm(args, joined, plan, path, gate, node.node, stop)
    except BaseException:
        path.close()
        if relay is not None:
            relay.close()
        raise
    link = None
    puncher = None
    keeper = None
    try:
        task = plan.task or _build_task(args, joined, compute, plan.shard_seed, plan.model_device)
        built = sum(p.numel() for p in task.model.parameters())
        if built != plan.numel:
            raise ConfigError(f"the task's model has {built} parameters, its spec says {plan.numel}")
        _announce(joined.spec.run.name, node, created, swarm, args, plan, node_env, path, relay)
        puncher = _puncher(args, joined, swarm, path)
        link = _link_to_coordinator(args, joined, swarm, stop, path, relay, puncher)
        keeper = _relay_keeper(args, joined, swarm, path, link, puncher)
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
            _say_punched(path)
        path.close()
        if relay is not None:
            carried = relay.stats()
            relay.close()
            if carried is not None:
                print(f"relay: carried {carried.bytes_relayed:,} bytes for peers nobody can dial", flush=True)
        if plan.local_node is not None:
            plan.local_node.close()
    if link is not None and link.credit is not None:
        print(f"coordinator: {link.credit.describe()}", flush=True)
    print("peer stopped cleanly", flush=True)
    _hold_late_signals()
    return 0


def _identities(args: argparse.Namespace) -> tuple[NodeIdentity, bool, object]:
    """The account key (created if absent, said once) and this node's key endorsed by it;
    whether the account was created; the checkpoint directory's lock (one peer per directory)."""
    from protocol.identity import default_key_path, load_or_create

    key_path = args.key or default_key_path()
    account, created = load_or_create(key_path)
    if created:
        print(
            f"created your account key at {key_path} (mode 0600): it is your identity and holds your credit; "
            "back it up, and use it on every machine you run peers on",
            flush=True,
        )
    node, checkpoint_lock = node_identity(account, args.checkpoint_dir)
    return node, created, checkpoint_lock


def _join(args: argparse.Namespace, node: NodeIdentity, node_env: NodeEnv | None, stop: threading.Event) -> _Joined:
    """The run: through the coordinator (``--coordinator``: joined; the spec is the
    coordinator's, and its DHT addresses join ``args.initial_peers``), else ``--spec``."""
    from protocol.spec import load_spec, parse_spec

    if not args.coordinator:
        return _Joined(load_spec(args.spec), args.data_slot)
    from peer.link.coordinator_client import CoordinatorClient, JoinAs, join_when_up
    from peer.link.coordinator_pin import PinnedKeys
    from peer.swarm.bootstrap import bootstrap_for
    from protocol.version import __version__

    pins = PinnedKeys(args.checkpoint_dir)
    client = CoordinatorClient(
        args.coordinator,
        node.node,
        software_version=__version__,
        endorsement=node.endorsement,
        local_ranks=node_env.world_size if node_env is not None else 1,
        coordinator_key=_coordinator_key(args.coordinator_key) or pins.expected(args.coordinator),
    )
    local_digest = load_spec(args.spec).digest() if args.spec else ""
    who = JoinAs(spec_digest=local_digest, reachable=not args.client_mode)
    info = join_when_up(client, who, say=lambda line: print(line, flush=True), sleep=_until_stopped(stop))
    pins.remember(args.coordinator, info.coordinator_key)
    spec = parse_spec(info.spec_toml, source=f"spec from {args.coordinator}")
    if spec.digest() != info.spec_digest:
        raise ConfigError(f"the coordinator's spec does not match the digest it announced ({info.spec_digest})")
    if local_digest and info.spec_digest != local_digest:
        raise ConfigError(
            f"the coordinator at {args.coordinator} runs {info.spec_digest}, not the --spec given ({local_digest}); "
            "drop --spec to take the coordinator's, or check the address"
        )
    # the coordinator's DHT addresses on the host we reached it on (see peer.swarm.bootstrap)
    args.initial_peers = bootstrap_for(info.bootstrap_maddrs, args.coordinator) + list(args.initial_peers)
    return _Joined(spec, info.data_slot, client, info)


def _coordinator_key(given: str | None) -> PublicKey | None:
    if not given:
        return None
    try:
        return PublicKey.from_id(given)
    except IdentityError as exc:
        raise ConfigError(f"--coordinator-key: {exc}") from exc


def _checked_compute(args: argparse.Namespace, joined: _Joined) -> RunSpec:
    """The spec this peer builds its task from (its own micro-batches, checkpointing and
    compilation: never the run's spec or its digest), once a token run's data and weights are
    checked to be the run's. Refused here, the peer gives its data stream back."""
    spec = joined.spec
    try:
        compute = _local_compute(spec, args)
        if spec.data.source == "tokens":
            from peer.task.tokens import open_data

            _, _, fetcher = open_data(spec, args.data_dir)  # the manifest and tokenizer: fetched now
            if fetcher is not None:
                fetcher.close()
            lm = spec.task.causal_lm
            if lm is not None and lm.weights is not None:
                from protocol.manifest import weights_sha256

                weights = args.weights_dir or str(lm.weights_path)
                if weights_sha256(weights) != lm.weights:
                    raise ConfigError(f"weights mismatch: the weights in {weights} are not the run's {lm.weights}")
    except ConfigError:
        joined.leave()
        raise
    return compute


def _until_stopped(stop: threading.Event, waited_for: str = "the coordinator") -> Callable[[float], None]:
    """A pause between tries that a SIGINT/SIGTERM ends: the peer then exits at once, cleanly
    (nothing is running yet), instead of waiting on for ``waited_for`` (a coordinator, the
    swarm's bootstrap peers) that is not there."""

    def pause(seconds: float) -> None:
        if stop.wait(seconds):
            print(f"stopped before {waited_for} answered", flush=True)
            raise SystemExit(0)

    return pause


def _data_cap(gb: float | None) -> int | None:
    return None if gb is None else int(gb * 1e9)


def _build_task(args: argparse.Namespace, joined: _Joined, compute: RunSpec, shard_seed: int, device: str) -> Task:
    from peer.task import build_task

    return build_task(
        compute,
        shard_seed=shard_seed,
        device=device,
        slot=joined.slot,
        data_dir=args.data_dir,
        weights_dir=args.weights_dir,
        data_cap_bytes=_data_cap(args.data_cap),
    )


def _plan(
    args: argparse.Namespace, joined: _Joined, compute: RunSpec, node: NodeIdentity, node_env: NodeEnv | None
) -> _Plan:
    """Where and over which local ranks this node trains. The model's size decides whether it
    shards (``use_fsdp``) and sizes the averager. hivemind's DHT and averager processes are
    forked from this one, so the model is built after them, or each would keep its first pages
    (copy-on-write) once training rewrites them: one more copy in host memory. Only a task whose
    size the spec does not say (``known_param_count``) is built first, to measure it. The other
    local ranks get what they need to build theirs (``LocalNode.share``)."""
    from peer.task import known_param_count

    device = _device(args.device, node_env)
    local_node = None
    if node_env is not None:
        from peer.node.node import LocalNode

        local_node = LocalNode(node_env, device=device)
    shard_seed = args.shard_seed if args.shard_seed is not None else node.seed
    task: Task | None = None
    numel = known_param_count(joined.spec)
    shard = local_node is not None and use_fsdp(args.fsdp, numel, device)
    if numel is None:
        task = _build_task(args, joined, compute, shard_seed, "cpu" if shard else device)
        numel = sum(p.numel() for p in task.model.parameters())
        shard = local_node is not None and use_fsdp(args.fsdp, numel, device)
        if shard:
            task.model.to("cpu")
    if local_node is not None:
        spec_text = joined.info.spec_toml if joined.info is not None else args.spec.read_text()
        paths = {
            name: str(value) if value is not None else None
            for name, value in (("data_dir", args.data_dir), ("weights_dir", args.weights_dir))
        }
        paths["data_cap"] = None if args.data_cap is None else str(args.data_cap)
        local_node.share(
            {
                "spec": spec_text,
                "seed": shard_seed,
                "shard": shard,
                "slot": joined.slot,
                "micro_batches": args.micro_batches,
                "activation_checkpointing": args.activation_checkpointing,
                "compile": args.compile,
                **paths,
            }
        )
    return _Plan(device, local_node, numel, shard, shard_seed, task)


def _network_path(args: argparse.Namespace, joined: _Joined) -> NetworkPath:
    """How others reach this peer (``peer.net.network_path``); ``args.port`` and ``args.client_mode``
    follow the choice."""
    from peer.net.network_path import Coordinated, choose_path

    coordinated = None
    if joined.client is not None and joined.info is not None:
        info = joined.info
        coordinated = Coordinated(
            address=args.coordinator,
            stub=joined.client.stub,
            relay_port=info.relay_port,
            token=lambda: info.access_token,
            sign=joined.client.identity.sign,
            relays=info.relays,
        )
    host = args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1"
    path = choose_path(
        client_mode=args.client_mode,
        announce=args.announce,
        port=args.port,
        env=os.environ,
        coordinated=coordinated,
        local_host=host,
        hole_punch=args.hole_punch,
    )
    args.port, args.client_mode = path.port, path.client_mode
    return path


def _member_gate(joined: _Joined) -> MemberGate | None:
    """Which peers the run's coordinator admitted, from its tokens and revocations in the DHT
    (``protocol.membership``; refreshed by the swarm); None without a coordinator."""
    if joined.info is None:
        return None
    from protocol.membership import MemberGate
    from protocol.statesync import run_prefix

    return MemberGate(
        coordinator_key=joined.info.coordinator_key,
        run_digest=joined.info.spec_digest,
        prefix=run_prefix(joined.info.spec_digest),
    )


def _relay_offer(
    args: argparse.Namespace, joined: _Joined, path: NetworkPath, gate: MemberGate | None
) -> RelayOffer | None:
    """The relay this peer runs for peers nobody can dial (``peer.net.relay_service``): only a peer
    the coordinator dialled back; None without a coordinator. It refuses the peers ``gate``
    shows revoked."""
    if joined.client is None or joined.info is None:
        return None
    from peer.net.relay_service import RelayOffer, offer_relay, relay_ports

    if not path.dialled_back:
        return RelayOffer(None, f"this peer is {path.kind}, not dialled back directly")
    ports, why_not = relay_ports(args.relay_ports)
    return offer_relay(
        ports,
        why_not,
        stub=joined.client.stub,
        coordinator_key=joined.info.coordinator_key,
        run_digest=joined.info.spec_digest,
        host=args.host or "0.0.0.0",
        revoked=(lambda: gate.revoked) if gate is not None else frozenset,
    )


def _start_swarm(
    args: argparse.Namespace,
    joined: _Joined,
    plan: _Plan,
    path: NetworkPath,
    gate: MemberGate | None,
    identity: Identity,
    stop: threading.Event | None = None,
) -> Swarm:
    """This peer's DHT node and averager; in a coordinator's run only peers holding its tokens
    average with it (``gate``). With an announced address, the
    daemon advertises it instead of the addresses it sees locally, and takes itself as publicly
    reachable (libp2p's AutoNAT would otherwise drop a public address it could not confirm)."""
    from engine.codecs import get_codec
    from engine.update_store import UpdateStore
    from peer.swarm.swarm import Swarm

    ip = "0.0.0.0" if args.host in ("0.0.0.0", "") else args.host
    updates = None
    if not args.client_mode and args.keep_updates > 0:
        # (a checkpoint dir is one peer's: its lock; else a directory of this process's own)
        where = args.checkpoint_dir / "updates" if args.checkpoint_dir is not None else None
        updates = UpdateStore(where or Path(tempfile.mkdtemp(prefix="swarmtrain-updates-")), keep=args.keep_updates)
    return Swarm(
        joined.spec,
        plan.numel,
        get_codec(joined.spec.averaging.compression, joined.spec.averaging.density, joined.spec.averaging.bits),
        initial_peers=list(args.initial_peers),
        host_maddrs=[f"/ip4/{ip}/tcp/{args.port}"],
        client_mode=args.client_mode,
        gate=gate,
        dht_kwargs=path.dht_kwargs,
        updates=updates,
        identity=identity,
        bootstrap_wait_s=BOOTSTRAP_WAIT_S,
        bootstrap_pause=_until_stopped(stop, "the swarm's bootstrap peers") if stop is not None else time.sleep,
    )


def _renewed(token: bytes, swarm: Swarm, path: NetworkPath | None, puncher: Puncher | None = None) -> None:
    """A renewed access token goes to the swarm's membership record, to the relays it holds
    ports on, and to the puncher (relays admit punches by token)."""
    swarm.publish_membership(token)
    if path is not None:
        path.use_token(token)
    if puncher is not None:
        puncher.use_token(token)


def _puncher(args: argparse.Namespace, joined: _Joined, swarm: Swarm, path: NetworkPath) -> Puncher | None:
    """Hole punching to the relayed peers this one dials (``peer.net.puncher``), with
    ``--hole-punch`` (the default): through a coordinator, which lists the relays; not in client mode."""
    if joined.info is None or joined.client is None or args.client_mode or not args.hole_punch:
        return None
    from peer.net.puncher import Puncher, relays_by_ip

    listed = list(joined.info.relays)
    if joined.info.relay_port:
        listed.append((parse_host_port(args.coordinator, what="--coordinator")[0], joined.info.relay_port))
    relays = relays_by_ip(listed)
    info = joined.info
    puncher = Puncher(
        swarm.dht,
        relays=relays,
        token=lambda: info.access_token,
        sign=joined.client.identity.sign,
        quiet=lambda: not swarm.averaging(),
        direct=path.direct,
    )
    puncher.start()
    return puncher


def _relay_keeper(
    args: argparse.Namespace,
    joined: _Joined,
    swarm: Swarm,
    path: NetworkPath,
    link: CoordinatorLink | None,
    puncher: Puncher | None,
) -> RelayKeeper | None:
    """A relayed peer's watch over its relays (``peer.net.relay_keeper``): when all have left, new
    ones from the coordinator's list, and the swarm moved to them."""
    if path.kind != "relayed" or joined.client is None or link is None:
        return None
    from peer.net.network_path import Coordinated
    from peer.net.relay_client import RelayAddress, RelayTunnel, open_several
    from peer.net.relay_keeper import PUBLISH_S, Found, RelayKeeper

    client = joined.client
    host = args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1"
    latest: list[bytes] = []

    def find() -> Found:
        info = client.join_as(link.rejoin)
        latest[:] = [info.access_token]
        listed = Coordinated(
            address=args.coordinator,
            stub=client.stub,
            relay_port=info.relay_port,
            token=lambda: info.access_token,
            sign=client.identity.sign,
            relays=info.relays,
        )
        return Found(tuple(listed.relay_addresses()), info.access_token)

    def open_relays(relays: Sequence[RelayAddress], token: bytes) -> list[tuple[RelayTunnel, RelayAddress]]:
        return open_several(
            relays,
            token=lambda: token,
            sign=client.identity.sign,
            local_port=path.port,
            local_host=host,
            direct=path.direct,
            answer_punches=args.hole_punch,
        )

    def moved() -> None:
        link.rejoin = dataclasses.replace(link.rejoin, maddrs=tuple(swarm.visible_maddrs))
        if puncher is not None:
            puncher.moved(swarm.dht)
        if latest:
            path.use_token(latest[0])
            if puncher is not None:
                puncher.use_token(latest[0])
            end = time.monotonic() + PUBLISH_S  # the new node stores nothing before it meets others
            while not swarm.publish_membership(latest[0], timeout_s=5.0) and time.monotonic() < end:
                time.sleep(1.0)

    keeper = RelayKeeper(
        path,
        find=find,
        open_relays=open_relays,
        move=swarm.move_to,
        moved=moved,
        say=lambda line: print(line, flush=True),
    )
    keeper.start()
    return keeper


def _say_punched(path: NetworkPath) -> None:
    """The punches other peers asked this one for at its relays, at exit."""
    answered = sum(tunnel.punched for tunnel in path.tunnels)
    if path.tunnels:
        carried = sum(tunnel.bytes_punched for tunnel in path.tunnels)
        print(f"hole punch: answered {answered} (carried {carried:,} bytes directly)", flush=True)


def _link_to_coordinator(
    args: argparse.Namespace,
    joined: _Joined,
    swarm: Swarm,
    stop: threading.Event,
    path: NetworkPath | None = None,
    relay: RelayOffer | None = None,
    puncher: Puncher | None = None,
) -> CoordinatorLink | None:
    """Through a coordinator: join again with this peer's swarm addresses (the token now names
    its libp2p id), publish the membership token, and start the heartbeats and reports."""
    if joined.client is None or joined.info is None:
        return None
    from peer.link.coordinator_client import JoinAs, join_when_up
    from peer.link.coordinator_link import CoordinatorLink
    from peer.link.report_outbox import OUTBOX_DIR, ReportOutbox

    rejoin = JoinAs(
        libp2p_peer_id=str(swarm.dht.peer_id),
        maddrs=tuple(swarm.visible_maddrs),
        reachable=not args.client_mode,
        spec_digest=joined.info.spec_digest,
        network_path=path.kind if path is not None else "",
        relay_port=relay.control_port if relay is not None else 0,
    )
    admitted = join_when_up(joined.client, rejoin, say=lambda line: print(line, flush=True))
    _renewed(admitted.access_token, swarm, path, puncher)
    link = CoordinatorLink(
        joined.client,
        interval_s=joined.info.heartbeat_interval_s,
        rejoin=rejoin,
        on_refused=lambda reason: stop.set(),
        token=admitted.access_token,
        on_token=lambda token: _renewed(token, swarm, path, puncher),
        data_slot=joined.slot if joined.spec.data.source == "tokens" else None,
        outbox=ReportOutbox(args.checkpoint_dir / OUTBOX_DIR if args.checkpoint_dir is not None else None),
    )
    if path is not None:
        link.punched_peers = lambda: len(path.direct)
    link.start()
    print(f"joined through coordinator {args.coordinator}", flush=True)
    return link


def _train(
    args: argparse.Namespace,
    spec: RunSpec,
    task: Task,
    swarm: Swarm,
    plan: _Plan,
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


def _device(requested: str | None, node_env: Any) -> str:
    """The torch device of this process: ``--device``, else CUDA if there is one; with several
    local ranks on CUDA, rank r takes GPU r."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if node_env is not None and device == "cuda":
        return f"cuda:{node_env.rank}"
    return device


TRAINING_BYTES_PER_PARAM = 16
"""fp32 parameters, gradients and AdamW's two moments."""


def use_fsdp(choice: str, numel: int | None, device: str) -> bool:
    """Whether a node of several ranks shards its model (``--fsdp``): ``on``/``off``, or ``auto``:
    on CUDA when the training state, with a quarter more for activations and buffers, exceeds
    one GPU's memory (unknown size: no); never on CPU."""
    if choice != "auto":
        return choice == "on"
    if numel is None or not device.startswith("cuda"):
        return False
    import torch

    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return numel * TRAINING_BYTES_PER_PARAM * 1.25 > memory


def _local_compute(spec: RunSpec, args: argparse.Namespace) -> RunSpec:
    """The spec this peer builds its task from: the run's, with ``--micro-batches`` and
    ``--activation-checkpointing`` applied (``protocol.spec.local_compute``)."""
    from protocol.spec import local_compute

    checkpointing = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    compile_blocks = None if args.compile is None else args.compile == "on"
    return local_compute(
        spec, micro_batches=args.micro_batches, checkpointing=checkpointing, compile_blocks=compile_blocks
    )


def _run_worker(args: argparse.Namespace, node_env: Any) -> int:
    """A local rank other than the leader: it trains what the leader tells it (``peer.node.node``);
    the leader alone talks to the swarm and the coordinator."""
    from peer.node.node import LocalNode, rank_shard_seed, run_worker
    from peer.task import build_task
    from protocol.spec import parse_spec

    local_node = LocalNode(node_env, device=_device(args.device, node_env))
    try:
        shared = local_node.share(None)
        spec = parse_spec(shared["spec"], source="the spec of this node's leader")
        args.micro_batches = shared.get("micro_batches")
        args.activation_checkpointing = shared.get("activation_checkpointing")
        args.compile = shared.get("compile")
        spec = _local_compute(spec, args)  # the leader's choice (checked there)
        seed = rank_shard_seed(int(shared["seed"]), node_env.rank)
        shard = bool(shared["shard"])
        # a node holds consecutive data streams, one per rank
        slot = None if shared["slot"] is None else int(shared["slot"]) + node_env.rank
        device = "cpu" if shard else local_node.device
        task = build_task(
            spec,
            shard_seed=seed,
            device=device,
            slot=slot,
            data_dir=shared["data_dir"],
            weights_dir=shared["weights_dir"],
            data_cap_bytes=_data_cap(None if shared.get("data_cap") is None else float(shared["data_cap"])),
        )
        run_worker(local_node, spec, task, shard=shard)
    finally:
        local_node.close()
    # done, cleanly: leave without the interpreter's finalization, which destroys what gloo's
    # worker threads may still hold (FSDP2's async work) and then aborts the process now and
    # then ("terminate called without an active exception": a rank killed by SIGABRT after
    # a clean stop). This rank writes no files; its output is flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _announce(
    run_name: str,
    node: NodeIdentity,
    created: bool,
    swarm: Any,
    args: argparse.Namespace,
    plan: _Plan,
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
