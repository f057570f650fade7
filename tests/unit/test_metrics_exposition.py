"""``/metrics`` keeps one registry for the coordinator's life: counters are raw ``_total``s whose
``_created`` does not move between scrapes (so ``rate()`` works), and every value is read at
the scrape."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core import Coordinator
from coordinator.http.app import create_app
from coordinator.store import Decision


def scrape(client: TestClient) -> dict[str, dict[str, float]]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = {
            s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value for s in family.samples
        }
    return families


def test_counters_live_across_scrapes_and_follow_the_ledger(core: Coordinator) -> None:
    client = TestClient(create_app(core, threading.Lock(), clock=time.time))
    first = scrape(client)
    assert first["swarmtrain_credited_samples"]["swarmtrain_credited_samples_total"] == 0
    created = first["swarmtrain_credited_samples_created"]["swarmtrain_credited_samples_created"]
    core.store.record_claim(
        key="p", round=3, samples=40, group_json="[]", state_digest="d", duration_s=1.0, received_at=1.0
    )
    core.store.record_claim(
        key="q", round=3, samples=9, group_json="[]", state_digest="d", duration_s=1.0, received_at=1.0
    )
    core.store.finalize_round(
        round=3,
        decisions=[Decision("p", "granted", 40, 4.0, "ok"), Decision("q", "denied", 0, 0.0, "no")],
        mean_loss=2.5,
        now=2.0,
        validation_loss=2.75,
    )
    second = scrape(client)
    assert second["swarmtrain_credited_samples"]["swarmtrain_credited_samples_total"] == 40
    assert second["swarmtrain_credited_samples_created"]["swarmtrain_credited_samples_created"] == created
    assert second["swarmtrain_claims"]["swarmtrain_claims_total{status=granted}"] == 1
    assert second["swarmtrain_claims"]["swarmtrain_claims_total{status=denied}"] == 1
    assert second["swarmtrain_round"]["swarmtrain_round"] == 3
    assert second["swarmtrain_round_loss"]["swarmtrain_round_loss"] == 2.5
    assert second["swarmtrain_validation_loss"]["swarmtrain_validation_loss"] == 2.75
    assert second["swarmtrain_round_group_size"]["swarmtrain_round_group_size"] == 2
