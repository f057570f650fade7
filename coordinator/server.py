"""The coordinator process: a stable DHT bootstrap peer, the gRPC API, a ticker.

``CoordinatorServer.start`` brings up, in order: the store (SQLite WAL under the state
directory unless a URL is given), the coordinator's identity (``coordinator.key``) and a
hivemind DHT node with a persistent libp2p identity (``p2p.key``, so its multiaddr stays
the same across restarts and peers reconnect by themselves), then the gRPC server and a
thread that calls ``Coordinator.tick`` every second.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from coordinator.archive import CheckpointArchive
from coordinator.archiver import Archiver
from coordinator.core import Coordinator
from coordinator.exporter import ModelExporter
from coordinator.front.link import Fronts
from coordinator.front.process import FrontConfig
from coordinator.ratelimit import DEFAULT_RATE, SourceLimiter
from coordinator.servicer import SERVER_OPTIONS, CoordinatorServicer, add_health_service, add_to_server
from coordinator.store import Store, sqlite_url
from engine.p2p_identity import write_ed25519_identity
from engine.record_bounds import RunRecordBounds
from protocol.errors import ConfigError
from protocol.identity import Identity, load_or_create
from protocol.modelsize import task_params
from protocol.spec import RunSpec, parse_spec
from protocol.statesync import run_prefix
from relay.server import Relay, run_token_admission

logger = logging.getLogger(__name__)

TICK_S = 1.0
REVOCATIONS_REPUBLISH_S = 60.0


GRPC_THREADS = 64


@dataclass
class ServerConfig:
    spec_path: Path
    """Run spec (TOML)."""
    state_dir: Path
    """Keys and the default SQLite database live here."""
    db_url: str | None = None
    """SQLAlchemy URL; default: SQLite under state_dir."""
    host: str = "0.0.0.0"
    """Address to listen on."""
    grpc_port: int = 0
    """gRPC port (0: any free port)."""
    dht_port: int = 0
    """DHT (libp2p) port (0: any free port)."""
    http_port: int = 0
    """Dashboard, JSON API and /metrics port (0: any free port)."""
    archive_every: int = 10
    """Archive the swarm's state every this many rounds (0: no archive)."""
    archive_keep: int = 3
    """Archived checkpoints kept on disk."""
    operators: tuple[str, ...] = ()
    """Public ids besides the coordinator's own key that may send admin requests."""
    max_requests_per_source: float = DEFAULT_RATE
    """gRPC requests per second from one source address (``coordinator.ratelimit``; 0: none)."""
    log_to: tuple[str, ...] = ()
    """Experiment trackers for the swarm's figures (``protocol.experiment_log``)."""
    relay_port: int = 0
    """The relay's control port (``relay.server``; 0: any free port)."""
    relay_ports: range | None = None
    """Ports the relay grants to peers nobody can dial (None: no relay)."""
    heartbeat_processes: int = 1
    """Processes that take heartbeats (``coordinator.front``; 0: the gRPC port takes them)."""
    heartbeat_port: int = 0
    """Their port (0: any free port; peers learn it from their join answer)."""


class CoordinatorServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.stopped = threading.Event()
        self.grpc_port = 0
        self.dht = None
        self.archiver: Archiver | None = None
        self.exporter: ModelExporter | None = None
        self.relay: Relay | None = None
        self.fronts: Fronts | None = None
        self.archive_off = ""
        self._revoked: set[str] = set()
        self._revoked_published_at = -float("inf")
        self.experiment: Any = None
        """``protocol.experiment_log.ExperimentLog`` of ``config.log_to`` (None without)."""
        self._logged_round: int | None = None

    def start(self) -> None:
        from hivemind import DHT

        config = self.config
        spec_toml = Path(config.spec_path).read_text(encoding="utf-8")
        spec = parse_spec(spec_toml, source=str(config.spec_path))
        config.state_dir.mkdir(parents=True, exist_ok=True)
        identity, _ = load_or_create(config.state_dir / "coordinator.key")
        p2p_key = config.state_dir / "p2p.key"
        if not p2p_key.exists():  # Ed25519, not the RSA key hivemind would write (engine.p2p_identity)
            write_ed25519_identity(p2p_key)
        self.dht = dht = DHT(
            start=True,
            host_maddrs=[f"/ip4/{config.host}/tcp/{config.dht_port}"],
            identity_path=str(p2p_key),
            record_validators=[RunRecordBounds(run_prefix(spec.digest()))],
        )
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        averager, gate = self._archive_averager(spec, identity)  # forks its process: before the database and gRPC
        self.store = Store(config.db_url or sqlite_url(config.state_dir))
        self.core = Coordinator(
            spec=spec,
            spec_toml=spec_toml,
            identity=identity,
            store=self.store,
            bootstrap_maddrs=self.maddrs,
            operators=config.operators,
        )
        self.archiver = None
        if averager is not None and gate is not None:
            self.archiver = Archiver(
                averager=averager,
                dht=self.dht,
                identity=identity,
                archive=CheckpointArchive(
                    config.state_dir / "archive", spec_digest=spec.digest(), keep=config.archive_keep, spec=spec
                ),
                every=config.archive_every,
                finalized=lambda: self.store.rounds(limit=1000),
                fetch_timeout_s=spec.averaging.allreduce_timeout_s,
                run_digest=spec.digest(),
                token_ttl_s=spec.admission.token_ttl_s,
                gate=gate,
            )
            self.archiver.start()
            self.exporter = ModelExporter(self.archiver.archive, config.state_dir / "export")
            self.exporter.start()
        if config.relay_ports is not None:
            admit = run_token_admission(
                coordinator_key=self.core.identity.public_key,
                run_digest=self.core.digest,
                revoked=lambda: self._revoked,
            )
            self.relay = Relay(host=config.host, control_port=config.relay_port, ports=config.relay_ports, admit=admit)
            self.core.relay_port = self.relay.start()
            self.core.relay_stats = self.relay.stats
        self._publish_revocations(self.core.revoked_peers(), now=time.time(), wait=True)  # before peers join
        rate = config.max_requests_per_source
        if config.heartbeat_processes > 0:
            self.fronts = self._start_fronts(rate)
        # heartbeats run beside the locked calls (``CoordinatorServicer``): enough threads that
        # they are not all waiting for the lock behind reports
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_THREADS), options=SERVER_OPTIONS)
        fronts = self.fronts
        servicer = CoordinatorServicer(
            self.core,
            archive=self._archive_status,
            after_join=(lambda: fronts.sync(wait=True)) if fronts is not None else None,
        )
        self.servicer_lock = servicer.lock  # ticks and RPCs take turns on the core
        self.reports = servicer.reports
        add_to_server(servicer, self.server, limiter=SourceLimiter(rate) if rate > 0 else None)
        self.health = add_health_service(self.server)
        try:
            self.grpc_port = self.server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            self.grpc_port = 0
        if self.grpc_port == 0:
            raise ConfigError(f"cannot listen on {config.host}:{config.grpc_port}: choose another --grpc-port")
        if config.log_to:
            from protocol.experiment_log import ExperimentLog

            self.experiment = ExperimentLog(config.log_to, name=f"{self.core.spec.run.name}-coordinator")
        self.server.start()
        self.ticker = threading.Thread(target=self._tick_forever, daemon=True)
        self.ticker.start()
        self._start_http(servicer.lock)

    def _start_fronts(self, rate: float) -> Fronts:
        """The heartbeat processes (``coordinator.front``), their port told to joining peers."""
        core = self.core
        fronts = Fronts(
            FrontConfig(
                host=self.config.host,
                port=self.config.heartbeat_port,
                reuse_port=False,
                max_requests_per_source=rate,
                heartbeat_interval_s=core.health.config.heartbeat_interval_s,
                max_age_s=core.verifier.max_age_s,
                max_future_s=core.verifier.max_future_s,
            ),
            self.config.heartbeat_processes,
            apply=lambda batch: core.beats.apply_beats(batch.beats, now=time.time()),
            drain=core.beats.drain,
            everyone=core.beats.everyone,
        )
        core.heartbeat_port = fronts.start()
        return fronts

    def _archive_averager(self, spec: RunSpec, identity: Identity) -> tuple[Any, Any]:
        """The run's averager for state download/serving and its member gate, or Nones when
        the archive is off."""
        if self.config.archive_every == 0:
            self.archive_off = "off (--archive-every 0)"
            return None, None
        numel = task_params(spec)
        if numel is None:
            self.archive_off = "off (an imported task that declares no task.params)"
            return None, None
        from engine.averager import ExactAverager
        from engine.codecs import get_codec
        from protocol.membership import MemberGate

        self.archive_off = ""
        prefix = run_prefix(spec.digest())
        gate = MemberGate(coordinator_key=identity.public_key, run_digest=spec.digest(), prefix=prefix)
        averager = ExactAverager(
            numel,
            self.dht,
            codec=get_codec("none"),
            prefix=prefix,
            start=True,
            client_mode=False,
            gate=gate,
        )
        return averager, gate

    def _start_http(self, lock: threading.Lock) -> None:
        import socket

        import uvicorn

        from coordinator.http.app import create_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.http_port))
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.core, lock, archiver=self.archiver, exporter=self.exporter, grpc_port=self.grpc_port),
            log_level="warning",
            lifespan="off",
        )
        self.http = uvicorn.Server(config)
        self.http_thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, daemon=True)
        self.http_thread.start()

    def _archive_status(self) -> tuple[int | None, str]:
        if self.archiver is None:
            return None, self.archive_off or "off"
        checkpoints = self.archiver.checkpoints()
        config = self.config
        latest = max((c.round for c in checkpoints), default=None)
        return latest, f"every {config.archive_every} rounds, last {config.archive_keep} kept"

    def _tick_forever(self) -> None:
        while not self.stopped.wait(TICK_S):
            try:
                with self.server_lock():
                    self.core.tick(now=time.time())
                    revoked = self.core.revoked_peers()
                    figures = self._swarm_figures() if self.config.log_to else None
                self._publish_revocations(revoked, now=time.time())
                if self.fronts is not None:
                    self.fronts.mend()
                    self.fronts.sync()
                if figures is not None:
                    self._log_figures(*figures)
            except Exception:
                logger.exception("coordinator tick failed")

    def _swarm_figures(self) -> tuple[int, dict[str, Any]] | None:
        """The newest decided round's figures and the swarm's now, once per round."""
        rounds = self.core.store.rounds(limit=1)
        if not rounds or rounds[0].round == self._logged_round:
            return None
        latest = rounds[0]
        self._logged_round = latest.round
        summary = self.core.health.summary(time.time())
        return latest.round, {
            "swarm/mean_loss": latest.mean_loss,
            "swarm/validation_loss": latest.validation_loss,
            "swarm/group_size": latest.group_size,
            "swarm/samples": latest.samples,
            "swarm/peers_online": summary.peers_online,
            "swarm/samples_per_second": summary.samples_per_second,
        }

    def _log_figures(self, round_: int, figures: dict[str, Any]) -> None:
        if self.experiment is not None:
            self.experiment.scalars(round_, figures)

    def _publish_revocations(self, revoked: set[str], *, now: float, wait: bool = False) -> None:
        """Sign and store the revocation list when it changed or is due again (peers stop
        averaging with revoked peers within ``protocol.membership.RECHECK_S``)."""
        if revoked == self._revoked and now - self._revoked_published_at < REVOCATIONS_REPUBLISH_S:
            return
        from engine.records import RunRecords
        from protocol.membership import make_revocations

        core = self.core
        record = make_revocations(core.identity, revoked, now=now)
        RunRecords(self.dht, run_prefix(core.digest)).publish_revocations(
            core.identity, record, expires_at=now + core.spec.admission.token_ttl_s + 60.0, wait=wait
        )
        if revoked != self._revoked:
            logger.info("revocation list published: %d peer(s)", len(revoked))
        self._revoked, self._revoked_published_at = set(revoked), now

    def server_lock(self) -> threading.Lock:
        return self.servicer_lock

    def stop(self) -> None:
        self.stopped.set()
        if self.experiment is not None:
            self.ticker.join(timeout=2 * TICK_S)
            self.experiment.close()
        self.health.enter_graceful_shutdown()  # health checks answer NOT_SERVING from here on
        self.http.should_exit = True
        self.http_thread.join(timeout=10)
        self.server.stop(grace=2).wait()
        self.reports.close()
        if self.fronts is not None:
            self.fronts.stop()
        if self.exporter is not None:
            self.exporter.stop()
        if self.archiver is not None:
            self.archiver.stop()
        if self.relay is not None:
            self.relay.stop()
        if self.dht is not None:
            self.dht.shutdown()
        self.store.close()
