"""The gRPC status a refused request is answered with (``coordinator.servicer``): bad signatures
→ UNAUTHENTICATED, admission refusals → PERMISSION_DENIED, another run → FAILED_PRECONDITION,
malformed input → INVALID_ARGUMENT, a report that waited too long for its batch → UNAVAILABLE
(the peer sends it again later)."""

from __future__ import annotations

import grpc

from coordinator.reports import ReportsBusyError
from protocol.errors import AdmissionError, MalformedMessageError, VerificationError, WrongRunError

REFUSALS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (WrongRunError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdmissionError, grpc.StatusCode.PERMISSION_DENIED),
    (MalformedMessageError, grpc.StatusCode.INVALID_ARGUMENT),
    (VerificationError, grpc.StatusCode.UNAUTHENTICATED),
    (ReportsBusyError, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
"""In the order they are matched (the first class ``exc`` is an instance of)."""

REFUSED = tuple(kind for kind, _ in REFUSALS)
"""Every error a request may be refused with (anything else is a bug: it propagates)."""


def refusal(exc: Exception) -> grpc.StatusCode | None:
    """The status that answers ``exc``; None for an error no request is refused with."""
    for kind, code in REFUSALS:
        if isinstance(exc, kind):
            return code
    return None
