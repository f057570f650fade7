"""The gRPC servicer: a thin adapter from ``Coordinator`` to the wire.

Every handler verifies nothing itself; it calls the core under one lock (the core is not
thread-safe and is fast) and translates our errors into gRPC status codes with the
readable reason as the details: bad signatures → UNAUTHENTICATED, admission refusals →
PERMISSION_DENIED, another run → FAILED_PRECONDITION, malformed input → INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol.errors import AdmissionError, MalformedMessageError, VerificationError, WrongRunError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        core: Coordinator,
        *,
        clock: Callable[[], float] = time.time,
        archive: Callable[[], tuple[int | None, str]] | None = None,
    ) -> None:
        self.core = core
        self.clock = clock
        self.archive = archive
        """Returns (newest archived round or None, a line saying how the archive runs)."""
        self.lock = threading.Lock()

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        return self._call(context, lambda now: self.core.join(request.signed, now=now))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        return self._call(context, lambda now: self.core.heartbeat(request.signed, now=now))

    def ReportRound(self, request: pb.RoundReportRequest, context: grpc.ServicerContext) -> pb.RoundReportResponse:
        return self._call(context, lambda now: self.core.report_round(request.signed, now=now))

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

    def _call(self, context: grpc.ServicerContext, handler: Callable[[float], T]) -> T:
        try:
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
        except ValueError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        raise AssertionError("unreachable")

    @staticmethod
    def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, exc: Exception) -> Any:
        logger.info("refused a request: %s", exc)
        context.abort(code, str(exc))
