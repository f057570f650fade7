"""schemathesis against the coordinator's HTTP API, driven by its own OpenAPI document (issue #14):
every operation, with generated valid and invalid query parameters, never answers 5xx, and
every response matches the schema it declares (``coordinator.http.schemas``). The core behind
it holds real data: joined peers, granted and denied claims, rounds, an extreme heartbeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.generation.case import Case

from coordinator.core import Coordinator
from coordinator.http.app import create_app
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.unit.conftest import new_core


def _populated(directory: Path) -> Coordinator:
    core = new_core(directory)
    now = time.time()
    peers = [Identity.generate() for _ in range(3)]
    for peer in peers:
        body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
        core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)
    for round_ in (1, 2, 3):
        at = now + 30 * round_
        for i, peer in enumerate(peers):
            group = [
                pb.GroupMember(
                    public_key=p.public_key.raw, weight=8.0, offence="x100" if j == 2 and round_ == 3 else ""
                )
                for j, p in enumerate(peers)
            ]
            report = pb.RoundReportBody(
                round=round_,
                samples=8,
                compute_s=5.0,
                loss=3.0 - 0.1 * round_ - 0.01 * i,
                state_digest="d",
                group=group,
            )
            core.report_round(
                sign_message(peer, kinds.ROUND_REPORT, report.SerializeToString(), now=at).to_proto(), now=at
            )
        beat = pb.HeartbeatBody(round=round_, samples_per_second=1e12, samples_total=8 * round_, loss=2.5)
        core.heartbeat(sign_message(peers[0], kinds.HEARTBEAT, beat.SerializeToString(), now=at).to_proto(), now=at)
        core.tick(now=at + 20)
    return core


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    core = _populated(Path(tmp_path_factory.mktemp("http")))
    yield core
    core.store.close()


@pytest.fixture(scope="module")
def api(populated: Coordinator) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(populated, threading.Lock()))


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_within_its_schema(case: Case) -> None:
    case.call_and_validate()


def test_the_data_behind_the_api_is_there(populated: Coordinator) -> None:
    """(So that the schema run above checked real rows, not empty lists.)"""
    from coordinator.credits import OFFENCE

    store = populated.store
    assert len(store.peers()) == 3 and store.denials_by_peer(OFFENCE)
    assert store.credits_by_peer() and store.rounds()
    assert [(f.round, f.groups, f.states, f.peers_averaged, f.decided) for f in populated.round_view.figures()] == [
        (r, 1, 1, 3, True) for r in (3, 2, 1)
    ]  # /api/v1/status's rounds
