"""The gRPC servicer: a thin adapter from ``Coordinator`` to the wire.

Every handler verifies nothing itself; it calls the core under one lock (the core is not
thread-safe), heartbeats excepted (``Coordinator.heartbeat`` is: they must not queue behind a
report's or a tick's database writes), and translates our errors into gRPC status codes with the
readable reason as the details: bad signatures → UNAUTHENTICATED, admission refusals →
PERMISSION_DENIED, another run → FAILED_PRECONDITION, malformed input → INVALID_ARGUMENT.
``add_to_server`` registers it so that a request that does not even parse is INVALID_ARGUMENT
too (grpc's generated registration parses before the handler runs, answers INTERNAL and logs
a traceback per request: a flood under fuzzing), and caps request size (``MAX_REQUEST_BYTES``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from coordinator.core import Coordinator
from coordinator.front.wire import SERVICE
from coordinator.probe import ProbeLimitError, Prober
from coordinator.ratelimit import SourceLimiter, source_host
from coordinator.reports import ReportsBusyError, ReportWriter
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol.errors import AdmissionError, MalformedMessageError, VerificationError, WrongRunError
from relay.server import MAX_RELAYS_LISTED

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_REQUEST_BYTES = 1 << 20
"""Largest request the server reads: a round report of the largest group is ~300 KB."""
MAX_PENDING_CALLS = 16_384
"""Calls the server holds while every worker thread is busy (gRPC's own default: up to 1,000,
then some refused at random, all beyond 3,000, CANCELLED). A round's end brings one report per
peer within seconds, each holding a worker until its batch is committed: at 10,000 peers gRPC
cancelled 15% of a round's reports (``benchmarks/coordinator_load.py``). A waiting call holds
what its stream's flow-control window let in (64 KiB at first; gRPC's bandwidth probing can
widen it), and the per-source limit runs only once a call is taken, so one client can fill the
queue: the bound on that memory is this number times the window."""
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
"""Options for ``grpc.server``: a larger request is refused with RESOURCE_EXHAUSTED; the port is
bound without SO_REUSEPORT (gRPC's default would let a second coordinator share it, the kernel
splitting the peers between the two); a round's burst of reports waits rather than being
cancelled (``MAX_PENDING_CALLS``)."""


def add_to_server(servicer: CoordinatorServicer, server: grpc.Server, *, limiter: SourceLimiter | None = None) -> None:
    """Register ``servicer``'s methods, each parsing its own request: bytes that are not a
    valid request message get INVALID_ARGUMENT naming the message, and nothing else runs.
    With ``limiter``, a source over its rate gets RESOURCE_EXHAUSTED before anything else."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        request_type: type[Message] = getattr(pb, method.input_type.name)
        response_type: type[Message] = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _parsing(getattr(servicer, method.name), request_type, limiter),
            request_deserializer=None,  # raw bytes: parsed by the wrapper
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def add_health_service(server: grpc.Server) -> Any:
    """The standard ``grpc.health.v1.Health`` service (what container healthchecks, load
    balancers and ``grpc_health_probe`` ask): SERVING for the server ("") and for the
    coordinator's service, NOT_SERVING once the server shuts down. Returns its servicer."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def _parsing(
    handler: Callable[[Any, grpc.ServicerContext], Any], request_type: type[Message], limiter: SourceLimiter | None
) -> Callable[..., Any]:
    def parse_then_handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        if limiter is not None:
            source = source_host(context.peer())
            if not limiter.allow(source, time.monotonic()):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many requests from {source} (more than {limiter.rate:g}/s): slow down",
                )
        try:
            request = request_type.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            logger.info("refused a request that is not a %s: %s", request_type.__name__, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}")
        return handler(request, context)

    return parse_then_handle


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        core: Coordinator,
        *,
        clock: Callable[[], float] = time.time,
        archive: Callable[[], tuple[int | None, str]] | None = None,
        after_join: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.prober = Prober(
            spec_toml=core.spec_toml,
            spec_digest=core.digest,
            bootstrap_maddrs=lambda: list(core.bootstrap_maddrs),
            relay_port=lambda: core.relay_port,
            volunteer_relays=lambda: min(len(core.health.relays(self.clock())), MAX_RELAYS_LISTED),
        )
        """Answers ``swarmtrain doctor``'s probes (from the core's fixed fields: no lock)."""
        self.clock = clock
        self.archive = archive
        """Returns (newest archived round or None, a line saying how the archive runs)."""
        self.after_join = after_join
        """Called after each join answered (the heartbeat processes learn the peer first)."""
        self.lock = threading.Lock()
        self.reports = ReportWriter(core.record_reports, self.lock)
        """Round reports, recorded in batches (``coordinator.reports``)."""

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        source = source_host(context.peer())
        response = self._call(context, lambda now: self.core.join(request.signed, now=now, source=source))
        if self.after_join is not None:
            self.after_join()
        return response

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        # outside the lock: a heartbeat never waits for a report's or a tick's database writes
        return self._call(context, lambda now: self.core.heartbeat(request.signed, now=now), locked=False)

    def ReportRound(self, request: pb.RoundReportRequest, context: grpc.ServicerContext) -> pb.RoundReportResponse:
        # verified outside the lock, recorded in batches under it, answered once committed
        def verify_then_record(now: float) -> pb.RoundReportResponse:
            peer, body = self.core.verify_report(request.signed, now=now)
            return self.reports.submit((peer.id, body, now))

        return self._call(context, verify_then_record, locked=False)

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        status = self._call(context, lambda now: self.core.status(now=now))
        if self.archive is not None:
            last_round, description = self.archive()
            if last_round is not None:
                status.last_checkpoint_round = last_round
            status.archive = description
        return status

    def Admin(self, request: pb.AdminRequest, context: grpc.ServicerContext) -> pb.AdminResponse:
        return self._call(context, lambda now: self.core.admin(request.signed, now=now))

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        source = source_host(context.peer())
        # outside the lock: reads nothing the core changes, and a dial-back may take seconds
        try:
            return self.prober.answer(request, source=source)
        except ProbeLimitError as exc:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, exc)
        except MalformedMessageError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        raise AssertionError("unreachable")

    def _call(self, context: grpc.ServicerContext, handler: Callable[[float], T], *, locked: bool = True) -> T:
        try:
            if not locked:
                return handler(self.clock())
            with self.lock:
                return handler(self.clock())
        except WrongRunError as exc:
            self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, exc)
        except AdmissionError as exc:
            self._abort(context, grpc.StatusCode.PERMISSION_DENIED, exc)
        except MalformedMessageError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except VerificationError as exc:
            self._abort(context, grpc.StatusCode.UNAUTHENTICATED, exc)
        except ReportsBusyError as exc:
            self._abort(context, grpc.StatusCode.UNAVAILABLE, exc)
        except ValueError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        raise AssertionError("unreachable")

    @staticmethod
    def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, exc: Exception) -> Any:
        logger.info("refused a request: %s", exc)
        context.abort(code, str(exc))
