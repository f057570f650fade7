"""``/metrics`` keeps one registry for the coordinator's life: counters are raw ``_total``s whose
``_created`` does not move between scrapes (so ``rate()`` works), and every value is read at
the scrape. Per-peer figures (all-reduce time and bytes, failed rounds) and out-of-sync peers
come from real heartbeats and reports, built by the peer's own ``CoordinatorLink``; values out
of bounds are refused and change nothing."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core import Coordinator
from coordinator.health import HealthConfig, HealthTracker
from coordinator.http.app import create_app
from coordinator.store import ClaimStatus, ClaimVerdict
from peer.link.coordinator_link import CoordinatorLink
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import MalformedMessageError
from protocol.identity import Identity
from tests.unit.round_rows import T0, joined, link, row, send_reports, signed


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
        decisions=[
            ClaimVerdict("p", 3, ClaimStatus.GRANTED, 40, "ok", flops=4.0),
            ClaimVerdict("q", 3, ClaimStatus.DENIED, 0, "no"),
        ],
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


# --- per-peer figures: all-reduce time and bytes, failed rounds, out-of-sync peers ---------------


def beat(core: Coordinator, peer: Identity, peer_link: CoordinatorLink, now: float) -> None:
    assert core.heartbeat(signed(peer, kinds.HEARTBEAT, peer_link.heartbeat_body(), now), now=now).admitted


def label(peer: Identity) -> str:
    return peer.public_key.id[:20]


def test_per_peer_figures_from_real_heartbeats_and_reports(core: Coordinator) -> None:
    """Three peers' links turn their trainers' rows into heartbeats and reports; the core takes
    them; ``/metrics`` shows each online peer's last all-reduce time, its bytes, its failed
    rounds, the swarm's failed rounds and who is out of sync with round 1's agreed digest."""
    clock = [T0 + 1]
    client = TestClient(create_app(core, threading.Lock(), clock=lambda: clock[0]))
    a, b, c = joined(core), joined(core), joined(core)
    links = {a: link(), b: link(), c: link()}
    for peer, peer_link in links.items():  # each link's first heartbeat: nothing failed yet
        beat(core, peer, peer_link, T0 + 1)
    before = scrape(client)
    assert before["swarmtrain_rounds_failed"]["swarmtrain_rounds_failed_total"] == 0
    assert set(before["swarmtrain_peer_failed_rounds"].values()) == {0}
    assert len(before["swarmtrain_peer_failed_rounds"]) == 3
    assert before["swarmtrain_peers_out_of_sync"]["swarmtrain_peers_out_of_sync"] == 0

    links[a].report(row(0, averaged=False, digest="d0"))  # a failed round, then round 1 with b
    links[a].report(row(1, averaged=True, digest="d1", members=[a, b], allreduce_s=0.5, bytes_sent=1000,
                        bytes_received=2000))  # fmt: skip
    links[b].report(row(1, averaged=True, digest="d1", members=[a, b], allreduce_s=0.75, bytes_sent=3000,
                        bytes_received=4000))  # fmt: skip
    links[c].report(row(1, averaged=False, digest="dX"))  # c says it is at round 1 with another state
    for peer, peer_link in links.items():
        send_reports(core, peer, peer_link, T0 + 130)
    core.tick(now=T0 + 200)  # both members reported: round 1 finalized, its agreed digest d1
    assert core.store.rounds(limit=1)[0].state_digest == "d1"
    for peer, peer_link in links.items():
        beat(core, peer, peer_link, T0 + 200)
    clock[0] = T0 + 201
    after = scrape(client)

    assert after["swarmtrain_peer_allreduce_seconds"] == {
        f"swarmtrain_peer_allreduce_seconds{{peer={label(a)}}}": 0.5,
        f"swarmtrain_peer_allreduce_seconds{{peer={label(b)}}}": 0.75,
    }  # c never reported an averaged round
    sent, received = after["swarmtrain_peer_sent_bytes"], after["swarmtrain_peer_received_bytes"]
    assert sent[f"swarmtrain_peer_sent_bytes_total{{peer={label(a)}}}"] == 1000
    assert sent[f"swarmtrain_peer_sent_bytes_total{{peer={label(b)}}}"] == 3000
    assert sent[f"swarmtrain_peer_sent_bytes_total{{peer={label(c)}}}"] == 0
    assert received[f"swarmtrain_peer_received_bytes_total{{peer={label(b)}}}"] == 4000
    assert after["swarmtrain_peer_sent_bytes_created"][f"swarmtrain_peer_sent_bytes_created{{peer={label(a)}}}"] == T0
    assert after["swarmtrain_peer_failed_rounds"] == {
        f"swarmtrain_peer_failed_rounds_total{{peer={label(a)}}}": 1,
        f"swarmtrain_peer_failed_rounds_total{{peer={label(b)}}}": 0,
        f"swarmtrain_peer_failed_rounds_total{{peer={label(c)}}}": 1,
    }
    assert after["swarmtrain_rounds_failed"]["swarmtrain_rounds_failed_total"] == 2
    assert core.out_of_sync(T0 + 201) == [c.public_key.id]
    assert after["swarmtrain_peers_out_of_sync"]["swarmtrain_peers_out_of_sync"] == 1

    # a's next round brings more bytes; c re-synced and landed round 2 (not finalized: not judged)
    links[a].report(row(2, averaged=True, digest="d2", members=[a, b], allreduce_s=0.25, bytes_sent=10,
                        bytes_received=20))  # fmt: skip
    links[c].report(row(2, averaged=True, digest="d2", members=[a, b, c], allreduce_s=0.25))
    send_reports(core, a, links[a], T0 + 205)
    for peer in (a, c):
        beat(core, peer, links[peer], T0 + 205)
    clock[0] = T0 + 206
    later = scrape(client)
    assert later["swarmtrain_peer_sent_bytes"][f"swarmtrain_peer_sent_bytes_total{{peer={label(a)}}}"] == 1010
    assert later["swarmtrain_peer_allreduce_seconds"][f"swarmtrain_peer_allreduce_seconds{{peer={label(a)}}}"] == 0.25
    assert later["swarmtrain_peers_out_of_sync"]["swarmtrain_peers_out_of_sync"] == 0
    assert later["swarmtrain_rounds_failed"]["swarmtrain_rounds_failed_total"] == 2  # counters never fall
    created = "swarmtrain_rounds_failed_created"
    assert later[created][created] == before[created][created]

    # a peer silent past the unreachable limit leaves the per-peer families (bounded labels)
    clock[0] = T0 + 205 + core.health.config.unreachable_s + 1
    gone = scrape(client)
    assert gone["swarmtrain_peer_sent_bytes"] == {}
    assert gone["swarmtrain_rounds_failed"]["swarmtrain_rounds_failed_total"] == 2


def test_the_latest_decided_round_shows_its_groups_states_and_peers_averaged(core: Coordinator) -> None:
    """Round 1: one group of three, one state. Round 2: {a, b} and {c, d} (d never reports),
    two states: the gauges follow the latest decided round, with no round label, and the
    split round is counted."""
    clock = [T0 + 1]
    client = TestClient(create_app(core, threading.Lock(), clock=lambda: clock[0]))
    a, b, c, d = (joined(core) for _ in range(4))
    links = {peer: link() for peer in (a, b, c, d)}
    empty = scrape(client)
    assert "swarmtrain_round_groups" not in empty and empty["swarmtrain_rounds_split"] == {"swarmtrain_rounds_split": 0}
    for peer in (a, b, c):
        links[peer].report(row(1, averaged=True, digest="s1", members=[a, b, c]))
        send_reports(core, peer, links[peer], T0 + 10)
    assert "swarmtrain_round_groups" not in scrape(client)  # reported, not decided yet
    core.tick(now=T0 + 20)  # every member reported: decided
    one = scrape(client)
    assert {name: one[name][name] for name in ROUND_GAUGES} == {
        "swarmtrain_round_groups": 1,
        "swarmtrain_round_states": 1,
        "swarmtrain_round_peers_averaged": 3,
        "swarmtrain_rounds_split": 0,
    }
    links[a].report(row(2, averaged=True, digest="s2", members=[a, b]))
    links[b].report(row(2, averaged=True, digest="s2", members=[a, b]))
    links[c].report(row(2, averaged=True, digest="s2-other", members=[c, d]))
    for peer in (a, b, c):
        send_reports(core, peer, links[peer], T0 + 130)
    core.tick(now=T0 + 200)  # d never reported: decided 60 s after the first claim
    clock[0] = T0 + 201
    split = scrape(client)
    assert {name: split[name][name] for name in ROUND_GAUGES} == {
        "swarmtrain_round_groups": 2,
        "swarmtrain_round_states": 2,
        "swarmtrain_round_peers_averaged": 4,
        "swarmtrain_rounds_split": 1,
    }
    assert all(len(split[name]) == 1 for name in ROUND_GAUGES)  # one series each: no round label


ROUND_GAUGES = (
    "swarmtrain_round_groups",
    "swarmtrain_round_states",
    "swarmtrain_round_peers_averaged",
    "swarmtrain_rounds_split",
)


def test_a_restarted_peer_counts_its_new_failures_and_a_rejoin_keeps_the_sums(core: Coordinator) -> None:
    peer = joined(core)
    first = link()
    beat(core, peer, first, T0 + 1)
    for round_ in range(3):
        first.report(row(round_, averaged=False, digest="d0"))
    beat(core, peer, first, T0 + 2)
    assert core.health.rounds_failed_total() == 3
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(signed(peer, kinds.JOIN, body, T0 + 3), now=T0 + 3)  # a token renewal: the count goes on
    first.report(row(0, averaged=False, digest="d0"))
    beat(core, peer, first, T0 + 4)
    assert core.health.rounds_failed_total() == 4
    restarted = link()  # the same node key, a new process: its count starts again
    beat(core, peer, restarted, T0 + 5)
    restarted.report(row(0, averaged=False, digest="d0"))
    beat(core, peer, restarted, T0 + 6)
    assert core.health.rounds_failed_total() == 5
    health = core.health.get(peer.public_key.id)
    assert health is not None and health.rounds_failed == 1


BAD_HEARTBEATS = {"rounds_failed": [-1, 2**31, 2**62]}
BAD_REPORTS = {"allreduce_s": [math.nan, math.inf, -math.inf, -1.0, 1e300, float(2**62)]}


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [(kinds.HEARTBEAT, f, v) for f, vs in BAD_HEARTBEATS.items() for v in vs]
    + [(kinds.ROUND_REPORT, f, v) for f, vs in BAD_REPORTS.items() for v in vs],
)
def test_bad_values_are_refused_naming_the_field_and_change_nothing(
    core: Coordinator, kind: str, field: str, value: float
) -> None:
    clock = [T0 + 10]
    client = TestClient(create_app(core, threading.Lock(), clock=lambda: clock[0]))
    peer, other = joined(core), joined(core)
    honest = link()
    honest.report(row(0, averaged=False, digest="d0"))
    honest.report(row(1, averaged=True, digest="d1", members=[peer, other], allreduce_s=0.5, bytes_sent=7))
    beat(core, peer, honest, T0 + 9)
    send_reports(core, peer, honest, T0 + 9)
    before = scrape(client)
    if kind == kinds.HEARTBEAT:
        body: Any = honest.heartbeat_body()
        call = core.heartbeat
    else:
        body = pb.RoundReportBody(
            round=2, samples=20, compute_s=5.0, state_digest="d2", bytes_sent=5,
            group=[pb.GroupMember(public_key=p.public_key.raw, weight=20.0) for p in (peer, other)],
        )  # fmt: skip
        call = core.report_round
    setattr(body, field, value)
    with pytest.raises(MalformedMessageError, match=field):
        call(signed(peer, kind, body, T0 + 10), now=T0 + 10)
    assert scrape(client) == before
    assert core.store.claims(key=peer.public_key.id, round=2) == []


def test_health_refuses_bad_figures_itself() -> None:
    """The tracker checks what it is given, whoever calls it (the core bounds them first)."""
    tracker = HealthTracker(HealthConfig())
    tracker.join("k", libp2p_peer_id="p", software_version="t", reachable=True, now=T0)
    figures = dict(now=T0, round=1, phase="training", samples_per_second=1.0, samples_total=1, loss=None)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="rounds_failed"):
            tracker.heartbeat("k", **figures, rounds_failed=bad)  # type: ignore[arg-type]
    for bad_s in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="allreduce_s"):
            tracker.record_report("k", allreduce_s=bad_s, bytes_sent=0, bytes_received=0)
    with pytest.raises(ValueError, match="bytes_sent"):
        tracker.record_report("k", allreduce_s=1.0, bytes_sent=-1, bytes_received=0)
    peer = tracker.get("k")
    assert peer is not None and (peer.rounds_failed, peer.allreduce_s, peer.bytes_sent) == (None, None, 0)


def test_peer_labels_stay_distinct() -> None:
    """Two online peers whose ids share the label's characters get their whole ids."""
    from coordinator.health import PeerHealth, PeerState
    from coordinator.http.metrics import _peer_labels

    def health(key: str) -> PeerHealth:
        return PeerHealth(key, "p", "t", True, T0, T0, PeerState.TRAINING)

    twins, single = ["ed25519:" + "A" * 12 + tail for tail in ("x" * 31, "y" * 31)], "ed25519:" + "B" * 43
    labels = _peer_labels([health(k) for k in [*twins, single]])
    assert labels == {twins[0]: twins[0], twins[1]: twins[1], single: single[:20]}
