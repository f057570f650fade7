"""``docker/grafana-dashboard.json`` cannot drift from ``/metrics``: every metric and label its
queries name is one a real ``SwarmCollector`` exposes (read from a real core that has every
family to show), it shows what an operator watches, and the compose stack wires Prometheus to
the coordinator and Grafana to Prometheus with files that are in the repository."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.core import Coordinator
from coordinator.http.metrics import metrics_registry
from coordinator.store import ClaimStatus, ClaimVerdict
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.specs import TOKEN_RUN_SPEC
from tests.unit.conftest import new_core

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana-dashboard.json"

TOKEN_SPEC = TOKEN_RUN_SPEC
"""A token run: its coordinator shows the data families too."""

WATCHED = {
    "swarmtrain_round_loss",
    "swarmtrain_validation_loss",
    "swarmtrain_peers_online",
    "swarmtrain_credited_samples_total",
    "swarmtrain_peer_allreduce_seconds",
    "swarmtrain_peer_sent_bytes_total",
    "swarmtrain_peer_received_bytes_total",
    "swarmtrain_rounds_failed_total",
    "swarmtrain_peer_failed_rounds_total",
    "swarmtrain_peers_out_of_sync",
    "swarmtrain_round_group_size",
    "swarmtrain_claims_total",
    "swarmtrain_archive_age_seconds",
    "swarmtrain_data_epoch",
    "swarmtrain_round_groups",
    "swarmtrain_round_states",
    "swarmtrain_round_peers_averaged",
    "swarmtrain_rounds_split",
}
"""What issues #16 and #25 ask the dashboard to show."""
RATED = {
    "swarmtrain_credited_samples_total",
    "swarmtrain_peer_sent_bytes_total",
    "swarmtrain_peer_received_bytes_total",
    "swarmtrain_rounds_failed_total",
    "swarmtrain_claims_total",
}
"""Counters the dashboard must show as rates (a raw total means nothing on a chart)."""

METRIC = re.compile(r"\b(swarmtrain_[a-zA-Z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    made = new_core(tmp_path, TOKEN_SPEC)
    yield made
    made.store.close()


def exposed(core: Coordinator) -> dict[str, set[str]]:
    """Every sample name a real collector exposes, with its label names, once the core has
    a finalized round with losses, an archive, peers online with reports and heartbeats."""
    now = time.time()
    peers = [Identity.generate() for _ in range(2)]
    for peer in peers:
        body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
        core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)
    for peer in peers:
        beat = pb.HeartbeatBody(round=1, phase=pb.PEER_PHASE_TRAINING, state_digest="d", rounds_failed=1)
        core.heartbeat(sign_message(peer, kinds.HEARTBEAT, beat.SerializeToString(), now=now).to_proto(), now=now)
        report = pb.RoundReportBody(
            round=1, state_digest="d", compute_s=1.0, allreduce_s=0.5, bytes_sent=10, bytes_received=10,
            group=[pb.GroupMember(public_key=p.public_key.raw, weight=0.0) for p in peers],
        )  # fmt: skip
        core.report_round(
            sign_message(peer, kinds.ROUND_REPORT, report.SerializeToString(), now=now).to_proto(), now=now
        )
    core.tick(now=now + 1)  # both members reported: round 1 decided (the round view's gauges)
    core.store.record_claim(
        key="p", round=3, samples=40, group_json="[]", state_digest="d", duration_s=1.0, received_at=1.0
    )
    core.store.finalize_round(
        round=3,
        decisions=[ClaimVerdict("p", 3, ClaimStatus.GRANTED, 40, "ok", flops=4.0)],
        mean_loss=2.5,
        now=2.0,
        validation_loss=2.75,
    )
    registry = metrics_registry(core, lambda: now, archive_round=lambda: (3, now - 60.0))
    names: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and query variable."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], target.get("legendFormat", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query if isinstance(query, str) else query["query"], ""


def test_every_query_names_only_metrics_and_labels_the_coordinator_exposes(core: Coordinator) -> None:
    names = exposed(core)
    assert {
        "swarmtrain_peer_allreduce_seconds", "swarmtrain_data_epoch", "swarmtrain_archive_age_seconds",
        "swarmtrain_round_groups",
    } <= set(names), "the fixture must make every family appear"  # fmt: skip
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for where, expr, legend in queries(dashboard):
        found = METRIC.findall(expr)
        assert found, f"{where}: {expr!r} names no swarmtrain metric"
        labels: set[str] = set()
        for name, matchers in found:
            assert name in names, f"{where}: {expr!r} names {name}, which /metrics does not expose"
            for label in MATCHER.findall(matchers):
                assert label in names[name], f"{where}: {name} has no label {label!r} (it has {sorted(names[name])})"
            labels |= names[name]
            used.add(name)
        for label in LEGEND_LABEL.findall(legend):
            assert label in labels, f"{where}: legend {legend!r} names {label!r}, which {expr!r} does not carry"
        values_of = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr)
        if values_of is not None:  # a variable's values: the metric must carry that label
            assert values_of[2] in names[values_of[1]], f"{where}: {values_of[1]} has no label {values_of[2]!r}"
            continue
        for counter in RATED & {name for name, _ in found}:
            assert re.search(rf"(rate|increase)\(\s*{counter}\b", expr), f"{where}: {counter} shown raw, not rated"
        variable_names = {v["name"] for v in dashboard["templating"]["list"]} | {"__rate_interval", "__interval"}
        for variable in re.findall(r"\$\{?([a-zA-Z_][a-zA-Z0-9_]*)", expr):
            assert variable in variable_names, f"{where}: {expr!r} uses an undefined variable ${variable}"
    assert WATCHED <= used, f"the dashboard does not show {sorted(WATCHED - used)}"


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["DS_PROMETHEUS"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_the_compose_stack_scrapes_the_coordinator_and_provisions_the_dashboard() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    coordinator = [str(a) for a in services["coordinator"]["command"]]
    http_port = coordinator[coordinator.index("--http-port") + 1]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):  # a bind mount from the repository, not a named volume
                assert (DOCKER / source).exists(), f"service {name} mounts {source}, which is not in docker/"
            else:
                assert source in compose["volumes"], f"service {name}: volume {source} is not declared"
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"coordinator:{http_port}"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    provisioning = DOCKER / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert (datasource["type"], datasource["url"], datasource["isDefault"]) == (
        "prometheus",
        "http://prometheus:9090",
        True,
    )
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "swarmtrain.yaml").read_text())["providers"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    dashboard_path = provider["options"]["path"] + "/swarmtrain.json"
    assert mounted.get(dashboard_path) == "./grafana-dashboard.json"
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
