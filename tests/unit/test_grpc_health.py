"""The coordinator's gRPC port answers the standard health check (``grpc.health.v1``), asked
with the standard client, on a real gRPC server."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.servicer import SERVICE, add_health_service


def test_serving_until_shutdown() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = add_health_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        health.enter_graceful_shutdown()
        answer = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        channel.close()
        server.stop(grace=None)
