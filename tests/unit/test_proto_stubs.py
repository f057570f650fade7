"""The committed gRPC stubs match protocol/*.proto (run `make proto` when this fails)."""

from __future__ import annotations

from pathlib import Path

from protocol import protogen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generated = protogen.generate(tmp_path)
    assert generated, "no stubs generated"
    for path in generated:
        committed = protogen.PROTO_DIR / path.name
        assert committed.exists(), f"{committed.name} is not committed; run `make proto`"
        assert protogen.normalized(committed.read_text()) == protogen.normalized(path.read_text()), (
            f"protocol/{committed.name} is stale; run `make proto`"
        )


def test_stubs_import_and_define_the_api() -> None:
    from protocol import coordinator_pb2, coordinator_pb2_grpc

    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    assert {m.name for m in service.methods} == {"Join", "Heartbeat", "ReportRound", "GetStatus", "Admin", "Probe"}
    assert hasattr(coordinator_pb2_grpc, "CoordinatorStub")
