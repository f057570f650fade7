"""A peer's start, first half: its keys, the run it joins (through a coordinator, or its own
``--spec``), and the spec it computes with, checked before anything heavy starts. Imported by
``peer.cli.run`` once the arguments are checked and the signal handlers are in place."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peer.boot.compute import local_compute_spec
from peer.link.coordinator_client import CoordinatorClient, JoinAs, join_when_up
from peer.link.coordinator_pin import PinnedKeys
from peer.node.node_identity import NodeIdentity, node_identity
from peer.swarm.bootstrap import bootstrap_for
from protocol.errors import ConfigError, IdentityError
from protocol.identity import PublicKey, default_key_path, load_or_create
from protocol.manifest import weights_sha256
from protocol.spec import load_spec, parse_spec
from protocol.version import __version__

if TYPE_CHECKING:
    from peer.link.coordinator_client import JoinInfo
    from peer.node.node_env import NodeEnv
    from protocol.spec import RunSpec


@dataclass
class Joined:
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


def identities(args: argparse.Namespace) -> tuple[NodeIdentity, bool, object]:
    """The account key (created if absent, said once) and this node's key endorsed by it;
    whether the account was created; the checkpoint directory's lock (one peer per directory)."""
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


def join_run(args: argparse.Namespace, node: NodeIdentity, node_env: NodeEnv | None, stop: threading.Event) -> Joined:
    """The run: through the coordinator (``--coordinator``: joined; the spec is the
    coordinator's, and its DHT addresses join ``args.initial_peers``), else ``--spec``."""
    if not args.coordinator:
        return Joined(load_spec(args.spec), args.data_slot)

    pins = PinnedKeys(args.checkpoint_dir)
    client = CoordinatorClient(
        args.coordinator,
        node.node,
        software_version=__version__,
        endorsement=node.endorsement,
        local_ranks=node_env.world_size if node_env is not None else 1,
        coordinator_key=coordinator_key(args.coordinator_key) or pins.expected(args.coordinator),
    )
    local_digest = load_spec(args.spec).digest() if args.spec else ""
    who = JoinAs(spec_digest=local_digest, reachable=not args.client_mode)
    info = join_when_up(client, who, say=lambda line: print(line, flush=True), sleep=until_stopped(stop))
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
    return Joined(spec, info.data_slot, client, info)


def coordinator_key(given: str | None) -> PublicKey | None:
    if not given:
        return None
    try:
        return PublicKey.from_id(given)
    except IdentityError as exc:
        raise ConfigError(f"--coordinator-key: {exc}") from exc


def checked_compute(args: argparse.Namespace, joined: Joined) -> RunSpec:
    """The spec this peer builds its task from (its own micro-batches, checkpointing and
    compilation: never the run's spec or its digest), once a token run's data and weights are
    checked to be the run's. Refused here, the peer gives its data stream back."""
    spec = joined.spec
    try:
        compute = local_compute_spec(spec, args)
        if spec.data.source == "tokens":
            from peer.task.tokens import open_data  # torch: only a token run's peer needs it here

            _, _, fetcher = open_data(spec, args.data_dir)  # the manifest and tokenizer: fetched now
            if fetcher is not None:
                fetcher.close()
            lm = spec.task.causal_lm
            if lm is not None and lm.weights is not None:
                weights = args.weights_dir or str(lm.weights_path)
                if weights_sha256(weights) != lm.weights:
                    raise ConfigError(f"weights mismatch: the weights in {weights} are not the run's {lm.weights}")
    except ConfigError:
        joined.leave()
        raise
    return compute


def until_stopped(stop: threading.Event, waited_for: str = "the coordinator") -> Callable[[float], None]:
    """A pause between tries that a SIGINT/SIGTERM ends: the peer then exits at once, cleanly
    (nothing is running yet), instead of waiting on for ``waited_for`` (a coordinator, the
    swarm's bootstrap peers) that is not there."""

    def pause(seconds: float) -> None:
        if stop.wait(seconds):
            print(f"stopped before {waited_for} answered", flush=True)
            raise SystemExit(0)

    return pause
