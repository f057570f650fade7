"""The peer's side of the coordinator API: join, heartbeats and round reports, one call each
(``CoordinatorClient``), waiting for a coordinator that is down (``join_when_up``), and the
round report a recorded round makes (``peer.link.report_wire``). Every request is signed with the peer's
key. The running link (heartbeats, reports, re-joins) is ``peer.link.coordinator_link``.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from peer.link.coordinator_pin import verified_answer
from peer.link.datagram_beats import DatagramBeats
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol import kinds
from protocol.errors import AdmissionError, ConfigError, SwarmtrainError, WrongRunError
from protocol.identity import Identity, PublicKey
from protocol.messages import SignedMessage, sign_message

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0
HEARTBEAT_PORT_TIMEOUT_S = 3.0
"""A heartbeat to the heartbeat port that takes longer is sent to the gRPC address instead."""
HEARTBEAT_PORT_BACKOFF_S = 300.0
"""After the heartbeat port failed, heartbeats go to the gRPC address this long."""


class RejectedError(SwarmtrainError):
    """The coordinator refused this particular request as invalid (it will not take it later either)."""


class CoordinatorUnavailableError(SwarmtrainError):
    """The coordinator did not answer (down, restarting, unreachable, or too busy just now)."""


_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
JOIN_BACKOFF_FIRST_S = 1.0
JOIN_BACKOFF_MAX_S = 30.0
"""A peer waiting for its coordinator tries again after 1, 2, 4, ... s, at most this apart (each
pause drawn from 80-120% of it: thousands of peers whose coordinator restarts do not all come
back in the same second)."""

_NOT_HEARTBEATS = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
"""What a heartbeat port answers that is no longer the coordinator's heartbeat process: the gRPC
address takes the heartbeats then."""

_FATAL = {
    grpc.StatusCode.PERMISSION_DENIED: AdmissionError,
    grpc.StatusCode.FAILED_PRECONDITION: WrongRunError,
    grpc.StatusCode.INVALID_ARGUMENT: RejectedError,
    grpc.StatusCode.UNAUTHENTICATED: RejectedError,
}


@dataclass(frozen=True)
class JoinInfo:
    spec_toml: str
    spec_digest: str
    access_token: bytes
    bootstrap_maddrs: list[str]
    coordinator_key: PublicKey
    heartbeat_interval_s: float
    current_round: int
    data_slot: int | None = None
    """Token runs: the first data stream this node trains (None: the run gives none)."""
    relay_port: int = 0
    """The coordinator's relay port on its host (``relay.server``); 0: it runs none."""
    relays: tuple[tuple[str, int], ...] = ()
    """Volunteers' relays (host, control port), to try in this order before the coordinator's
    (entries that are not ``HOST:PORT`` are left out)."""
    heartbeat_port: int = 0
    """The port on the coordinator's host that takes heartbeats (0: its gRPC address does)."""


@dataclass(frozen=True)
class JoinAs:
    """What a peer says of itself when it joins (again): where it averages, and the run it
    holds the spec of."""

    libp2p_peer_id: str = ""
    maddrs: tuple[str, ...] = ()
    reachable: bool = True
    spec_digest: str = ""
    network_path: str = ""
    """How others reach it (``peer.net.network_path``): direct, announced, relayed or client."""
    relay_port: int = 0
    """The control port of the relay it runs for others (``peer.net.relay_service``); 0: none."""


# a restarted coordinator is found again within seconds (gRPC's default backoff grows to 120 s)
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def _relays(listed: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """The ``HOST:PORT`` entries of a join answer's relays, at most ``MAX_RELAYS_LISTED``; the
    rest (malformed: the coordinator is not trusted to send well-formed input) are logged and
    left out."""
    from peer.net.announce import parse_host_port
    from relay.server import MAX_RELAYS_LISTED

    relays: list[tuple[str, int]] = []
    for entry in listed[:MAX_RELAYS_LISTED]:
        try:
            relays.append(parse_host_port(entry, what="a relay in the join answer"))
        except ConfigError as exc:
            logger.warning("left out a relay: %s", exc)
    return tuple(relays)


class CoordinatorClient:
    """Signed, timed calls to one coordinator."""

    def __init__(
        self,
        address: str,
        identity: Identity,
        *,
        software_version: str,
        endorsement: SignedMessage | None = None,
        local_ranks: int = 1,
        coordinator_key: PublicKey | None = None,
        datagram_heartbeats: bool = True,
    ) -> None:
        """``identity`` signs every request; ``endorsement`` (the account's signature over its
        public key, see ``peer.node.node_identity``) names the account it earns for;
        ``coordinator_key``: the key its join answers must be signed with
        (``peer.link.coordinator_pin``; None: the first answer's signer, kept for later joins);
        ``datagram_heartbeats``: heartbeats go to the heartbeat port as UDP datagrams first
        (``peer.link.datagram_beats``), over gRPC where none is answered."""
        if ":" not in address:
            raise ConfigError(f"--coordinator must be HOST:PORT, got {address!r}")
        self.address, self.identity, self.software_version = address, identity, software_version
        self.endorsement = endorsement
        self.local_ranks = local_ranks
        self.coordinator_key = coordinator_key
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self._beats: tuple[str, grpc.Channel, pb_grpc.CoordinatorStub] | None = None
        """The heartbeat port's address, channel and stub (None: heartbeats go to ``address``)."""
        self._beats_failed_at = -float("inf")
        self.datagram_heartbeats = datagram_heartbeats
        self.datagrams: DatagramBeats | None = None
        """Heartbeats as datagrams to the heartbeat port (None: none named, or turned off)."""

    def join_as(self, who: JoinAs) -> JoinInfo:
        """``join`` saying ``who``."""
        return self.join(
            libp2p_peer_id=who.libp2p_peer_id,
            maddrs=list(who.maddrs),
            reachable=who.reachable,
            spec_digest=who.spec_digest,
            network_path=who.network_path,
            relay_port=who.relay_port,
        )

    def join(
        self,
        *,
        libp2p_peer_id: str = "",
        maddrs: list[str] | None = None,
        reachable: bool = True,
        spec_digest: str = "",
        network_path: str = "",
        relay_port: int = 0,
    ) -> JoinInfo:
        body = pb.JoinBody(
            libp2p_peer_id=libp2p_peer_id,
            software_version=self.software_version,
            spec_digest=spec_digest,
            hardware=_hardware(self.local_ranks),
            maddrs=maddrs or [],
            reachable=reachable,
            network_path=network_path,
            relay_port=relay_port,
        )
        if self.endorsement is not None:
            body.account_endorsement.CopyFrom(self.endorsement.to_proto())
        request = self._sign(kinds.JOIN, body)
        signed = self._call(self.stub.Join, pb.JoinRequest(signed=request))
        response, signer = verified_answer(
            signed, request_nonce=request.nonce, address=self.address, expected=self.coordinator_key
        )
        self.coordinator_key = signer  # a re-join must be answered by the same coordinator
        self._use_heartbeat_port(response.heartbeat_port)
        return JoinInfo(
            spec_toml=response.spec_toml,
            spec_digest=response.spec_digest,
            access_token=response.access_token,
            bootstrap_maddrs=list(response.bootstrap_maddrs),
            coordinator_key=signer,
            heartbeat_interval_s=response.heartbeat_interval_s or 5.0,
            current_round=response.current_round,
            relay_port=response.relay_port,
            relays=_relays(response.relays),
            data_slot=response.data_slot if response.HasField("data_slot") else None,
            heartbeat_port=response.heartbeat_port,
        )

    def _use_heartbeat_port(self, port: int) -> None:
        """Send heartbeats to ``port`` on the coordinator's host from now on (0: to its address)."""
        host = self.address.rsplit(":", 1)[0]
        address = f"{host}:{port}" if 0 < port <= 65535 else ""
        if self._beats is not None and self._beats[0] == address:
            return
        if self._beats is not None:
            self._beats[1].close()
            self._beats = None
        if self.datagrams is not None:
            self.datagrams.close()
            self.datagrams = None
        if address:
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._beats = (address, channel, pb_grpc.CoordinatorStub(channel))
            if self.datagram_heartbeats:
                try:
                    self.datagrams = DatagramBeats(host.strip("[]"), port)
                except OSError as exc:  # the host does not resolve for UDP: gRPC only
                    logger.info("no heartbeat datagrams to %s: %s", address, exc)

    def heartbeat(self, body: pb.HeartbeatBody) -> pb.HeartbeatResponse:
        """To the heartbeat port the join answer named, as a datagram first
        (``peer.link.datagram_beats``; unanswered: signed afresh, over gRPC), else (none named,
        or it failed within ``HEARTBEAT_PORT_BACKOFF_S``: a firewall, a process restarting) to the
        gRPC address.
        A leaving peer's heartbeat goes to the gRPC address: its answer is the peer's last
        account of its work, which must count the reports it has just sent (the heartbeat
        processes answer from tables that follow the coordinator by up to a tick)."""
        leaving = body.phase == pb.PEER_PHASE_LEAVING
        request = pb.HeartbeatRequest(signed=self._sign(kinds.HEARTBEAT, body))
        if self.datagrams is not None and not leaving and not self.datagrams.resting:
            answer = self.datagrams.send(request)
            if answer is not None:
                return answer
            # unanswered: it may have arrived all the same, and the same beat again is a replay
            request = pb.HeartbeatRequest(signed=self._sign(kinds.HEARTBEAT, body))
        beats = None if leaving else self._beats
        if beats is not None and time.monotonic() - self._beats_failed_at >= HEARTBEAT_PORT_BACKOFF_S:
            try:
                return beats[2].Heartbeat(request, timeout=HEARTBEAT_PORT_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() not in _UNAVAILABLE | _NOT_HEARTBEATS:
                    raise _FATAL.get(exc.code(), SwarmtrainError)(
                        f"coordinator heartbeats {beats[0]}: {plain_rpc_error(exc)}"
                    ) from exc
                logger.info(
                    "heartbeat port %s: %s; heartbeats go to %s for %.0f s",
                    beats[0],
                    plain_rpc_error(exc),
                    self.address,
                    HEARTBEAT_PORT_BACKOFF_S,
                )
                self._beats_failed_at = time.monotonic()
        return self._call(self.stub.Heartbeat, request)

    def leave(self) -> None:
        """Tell the coordinator this peer leaves (best effort): it goes offline at once and a
        token run's data streams are free for others."""
        try:
            self.heartbeat(pb.HeartbeatBody(phase=pb.PEER_PHASE_LEAVING))
        except SwarmtrainError as exc:
            logger.info("could not tell the coordinator we leave: %s", exc)

    def report_round(self, body: pb.RoundReportBody) -> pb.RoundReportResponse:
        return self._call(self.stub.ReportRound, pb.RoundReportRequest(signed=self._sign(kinds.ROUND_REPORT, body)))

    def _sign(self, kind: str, body: Any) -> pb.SignedEnvelope:
        return sign_message(self.identity, kind, body.SerializeToString(), now=time.time()).to_proto()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = (
                CoordinatorUnavailableError if exc.code() in _UNAVAILABLE else _FATAL.get(exc.code(), SwarmtrainError)
            )
            raise error(f"coordinator {self.address}: {plain_rpc_error(exc)}") from exc

    def close(self) -> None:
        self.channel.close()
        if self._beats is not None:
            self._beats[1].close()
        if self.datagrams is not None:
            self.datagrams.close()


def plain_rpc_error(exc: grpc.RpcError) -> str:
    """What a failed call to the coordinator means, in words, with what to check: gRPC's own
    details ("failed to connect to all addresses; last error: UNKNOWN: ipv4:...") say neither."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {RPC_TIMEOUT_S:g} s (a firewall, or the wrong port?)"
    if code == grpc.StatusCode.UNAVAILABLE:
        lowered = details.lower()
        if "connection refused" in lowered:
            return "connection refused: nothing listens there (is the coordinator running, and is this its gRPC port?)"
        if "dns" in lowered or "resolve" in lowered or "name or service not known" in lowered:
            return "the host name does not resolve (a typo in HOST?)"
        if "timeout" in lowered or "timed out" in lowered or "unreachable" in lowered:
            return "the address cannot be reached from here (a firewall, or a private address?)"
        return "not reachable (is the coordinator running, and is HOST:PORT its gRPC address?)"
    first = details.splitlines()[0] if details else code.name
    return first[:300]


def join_when_up(
    client: CoordinatorClient,
    who: JoinAs,
    *,
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    jitter: Callable[[], float] = lambda: random.uniform(0.8, 1.2),
) -> JoinInfo:
    """``client.join_as(who)``, tried again with backoff for as long as the coordinator does not
    answer (``CoordinatorUnavailableError``): a peer started while its coordinator is down or
    restarting joins once it is back. ``say`` gets one line when it first does not answer and one
    when it does. A refusal (admission, another run, a bad answer) is raised at once."""
    started = clock()
    pause = JOIN_BACKOFF_FIRST_S
    waited = False
    while True:
        try:
            info = client.join_as(who)
        except CoordinatorUnavailableError as exc:
            if not waited:
                say(
                    f"coordinator {client.address} is not answering ({exc}); trying again until it does "
                    "(Ctrl-C to stop)"
                )
                waited = True
            sleep(pause * jitter())
            pause = min(2 * pause, JOIN_BACKOFF_MAX_S)
            continue
        if waited:
            say(f"coordinator {client.address} answered after {clock() - started:.0f} s")
        return info


def _hardware(local_ranks: int) -> pb.Hardware:
    import torch

    hw = pb.Hardware(device="cpu", cpu_count=os.cpu_count() or 0, local_ranks=local_ranks)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        hw.device, hw.accelerator_count = "cuda", torch.cuda.device_count()
        hw.accelerator_name, hw.accelerator_memory_gib = props.name, props.total_memory / 2**30
    try:
        hw.ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    logger.debug("hardware on %s: %s", platform.node(), hw)
    return hw
