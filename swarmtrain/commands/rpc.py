"""One call to a coordinator from a command line (``status``, ``admin``): waits up to the
command's ``--timeout`` for the coordinator to come up (a script may start it just before),
then fails with one line naming the address."""

from __future__ import annotations

from typing import Any

from protocol.errors import SwarmtrainError


def call(address: str, method: str, request: Any, *, timeout: float) -> Any:
    """``Coordinator.<method>(request)`` at ``address``; ``SwarmtrainError`` on any failure."""
    import grpc

    from protocol import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        try:
            return getattr(stub, method)(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise SwarmtrainError(
                    f"coordinator {address}: no answer within {timeout:g} s (is it running, and is the address right?)"
                ) from exc
            raise SwarmtrainError(f"coordinator {address}: {exc.code().name}: {exc.details()}") from exc
