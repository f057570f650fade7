"""A real coordinator process and real peers: join, heartbeats, rounds finalized, credits
granted; a peer outside the allowlist is refused with a clear error."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from coordinator.store import Store
from protocol.identity import Identity
from protocol.membership import Lookup, MemberGate
from protocol.spec import load_spec
from protocol.statesync import run_prefix
from swarmtrain.localswarm import LocalCoordinator, LocalPeer, swarmtrain_executable, wait_all
from swarmtrain.localswarm import wait_until as wait_for
from tests.conftest import plain
from tests.integration.coordinator_status import status
from tests.specs import COORDINATOR_SPEC

SPEC = COORDINATOR_SPEC


def test_peers_join_train_and_earn_verified_credits(tmp_path: Path, server_db_url: str) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(mode="open", allowlist=""))
    coordinator = LocalCoordinator(spec, tmp_path / "state", db_url=server_db_url)
    peers: list[LocalPeer] = []
    try:
        address = coordinator.address()
        for i in range(3):
            args = [
                "--coordinator",
                address,
                "--host",
                "127.0.0.1",
                "--key",
                str(tmp_path / f"k{i}"),
                "--shard-seed",
                str(i),
                "--max-rounds",
                "4",
            ]
            peers.append(LocalPeer(args, tmp_path, f"peer{i}"))
        wait_for(lambda: status(address).get("peers_online", 0) == 3, 120, "3 peers online")
        for peer, code in zip(peers, wait_all(peers, 240)):
            assert code == 0, "\n".join(peer.lines[-20:])
        store = Store(server_db_url)
        wait_for(lambda: len(store.credits_by_peer()) == 3 and not store.pending_claims(), 120, "credits granted")
        credits = plain(store.credits_by_peer())
        trained = {p.name: sum(r["samples"] for r in p.rounds() if r["averaged"]) for p in peers}
        assert all(c["samples"] > 0 and c["flops"] > 0 for c in credits.values())
        for i, peer in enumerate(peers):  # each peer heard its credit from its heartbeats and said it
            said = re.search(r"^coordinator: credited ([\d,]+) samples", "\n".join(peer.lines), re.MULTILINE)
            assert said, "\n".join(peer.lines[-20:])
            key = peer.printed(r"^peer (\S+) of account (\S+)", 5)  # credited per node key
            account = Identity.load(tmp_path / f"k{i}").public_key.id
            assert peer.printed(r"^peer \S+ of account (\S+)", 5) == account
            assert {row.key: row.account_key for row in store.peers()}[key] == account
            assert int(said.group(1).replace(",", "")) <= credits[key]["samples"]
        assert sum(c["samples"] for c in credits.values()) <= sum(trained.values())
        assert store.rounds()
        # every report carries each other member's receipt for its parts, which the coordinator
        # checked and kept as that member's voucher ([key, weight, offence, [weight, offence]])
        for claim in store.claims():
            others = [entry for entry in json.loads(claim.group_json) if entry[0] != claim.key]
            assert others and all(len(entry) == 4 for entry in others), (claim.round, claim.group_json)
        final = status(address)
        assert final["current_round"] >= 1 and final["run_name"] == "coord"
        assert final["archive"].startswith("every ") and (
            final["last_checkpoint_round"] is None or final["last_checkpoint_round"] >= 0
        )
        table = subprocess.run(
            [*swarmtrain_executable(), "status", "--coordinator", address], capture_output=True, text=True, timeout=60
        )
        assert table.returncode == 0 and "archive every " in table.stdout, table.stdout + table.stderr
        # how each round averaged, against the peers' own metrics rows: three peers can form
        # only one group of min_group_size 3, so every round is one group, one state, 3 peers
        averaged = Counter(r["round"] for p in peers for r in p.rounds() if r["averaged"])
        assert final["rounds"] and {v["round"]: v["reports"] for v in final["rounds"]} == dict(averaged)
        for view in final["rounds"]:
            assert (view["groups"], view["states"], view["peers_averaged"], view["decided"]) == (1, 1, 3, True), view
        shown = [line.split() for line in table.stdout.splitlines()]
        header = shown.index(["round", "groups", "states", "averaged", "reports"])
        assert shown[header + 1] == [str(v) for v in (max(averaged), 1, 1, 3, averaged[max(averaged)])], table.stdout
        check_http(coordinator.http(), peers=3, rounds=final["rounds"])
        with grpc.insecure_channel(address) as channel:  # the standard health check, as a container asks it
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        store.close()
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()


def admin(address: str, key_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*swarmtrain_executable(), "admin", *args, "--coordinator", address, "--key-file", str(key_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_allowlist_is_enforced_and_edited_live_and_bans_drop_a_running_peer(tmp_path: Path, server_db_url: str) -> None:
    listed = Identity.generate()
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(mode="allowlist", allowlist=f'allowlist = ["{listed.public_key.id}"]'))
    coordinator = LocalCoordinator(spec, tmp_path / "state", db_url=server_db_url)
    operator_key = tmp_path / "state" / "coordinator.key"
    stranger_key = tmp_path / "stranger.key"
    stranger = observer = None
    try:
        address = coordinator.address()
        proc = subprocess.run(
            [*swarmtrain_executable(), "peer", "--coordinator", address, "--key", str(stranger_key)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1
        assert "not on this run's allowlist" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        stranger_id = Identity.load(stranger_key).public_key.id

        # only an operator may edit; a peer's own key is not one
        refused = admin(address, stranger_key, "allow", stranger_id)
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr and "not an operator" in refused.stderr
        allowed = admin(address, operator_key, "allow", stranger_id)
        assert allowed.returncode == 0 and f"allowed account {stranger_id}" in allowed.stdout, allowed.stderr
        listing = json.loads(admin(address, operator_key, "list", "--json").stdout)
        assert set(listing["allowlist"]) == {listed.public_key.id, stranger_id} and listing["bans"] == []

        # now it joins and trains; a ban drops it at once: it stops with the reason
        stranger = LocalPeer(
            ["--coordinator", address, "--host", "127.0.0.1", "--key", str(stranger_key), "--wait-for-group", "0"],
            tmp_path,
            "stranger",
        )
        stranger.printed(r"^(joined through coordinator)", 120)
        # authorized averaging: its token is in the run's DHT, and the ban revokes it there
        observer = MembershipObserver(spec, operator_key, coordinator.printed(r"^dht: (\S+)$", 60))
        stranger_p2p = stranger.printed(r"^listening: \S+/p2p/(\S+)$", 120)
        wait_for(lambda: observer.is_member(stranger_p2p), 60, "the stranger's token in the DHT")
        banned = admin(address, operator_key, "ban", stranger_id, "--reason", "testing bans")
        assert banned.returncode == 0 and "1 peer(s) dropped" in banned.stdout, banned.stdout + banned.stderr
        wait_for(lambda: not observer.is_member(stranger_p2p), 60, "the coordinator to revoke the token in the DHT")
        assert stranger.wait(timeout=120) == 1
        assert any("is banned from this run" in line for line in stranger.lines), "\n".join(stranger.lines[-10:])
        listing = json.loads(admin(address, operator_key, "list", "--json").stdout)
        assert [b["key"] for b in listing["bans"]] == [stranger_id] and listing["bans"][0]["reason"] == "testing bans"
        # a bad id is refused before anything is sent
        bad = admin(address, operator_key, "ban", "ed25519:nope")
        assert bad.returncode == 1 and "is not a public id" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        if observer is not None:
            observer.shutdown()
        if stranger is not None:
            stranger.kill()
        coordinator.kill()


class MembershipObserver:
    """A DHT node that reads a run's members and revocations the way a peer's averager does."""

    def __init__(self, spec: Path, coordinator_key: Path, dht_maddr: str) -> None:
        from hivemind import DHT

        digest = load_spec(spec).digest()
        self.gate = MemberGate(
            coordinator_key=Identity.load(coordinator_key).public_key, run_digest=digest, prefix=run_prefix(digest)
        )
        self.dht = DHT(initial_peers=[dht_maddr], client_mode=True, start=True)

    def is_member(self, peer_id: str) -> bool:
        members = self.dht.get(self.gate.key, latest=True)
        revocations = self.dht.get(self.gate.revocations_key, latest=True)
        self.gate.update(
            Lookup(
                members.value if members is not None else None, revocations.value if revocations is not None else None
            ),
            now=time.time(),
        )
        return self.gate.is_member(peer_id, now=time.time())

    def shutdown(self) -> None:
        self.dht.shutdown()


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


ROUND_GAUGES = (
    "swarmtrain_round_groups",
    "swarmtrain_round_states",
    "swarmtrain_round_peers_averaged",
    "swarmtrain_rounds_split",
)


def check_http(base: str, *, peers: int, rounds: list[dict]) -> None:
    """The HTTP API, ``/metrics`` and the dashboard page of a coordinator whose swarm is done;
    ``rounds``: its per-round view as ``swarmtrain status --json`` showed it."""
    code, _, body = get(base + "healthz")
    assert code == 200 and json.loads(body)["ok"]
    status_json = json.loads(get(base + "api/v1/status")[2])
    assert status_json["run_name"] == "coord" and status_json["current_round"] >= 1
    assert status_json["rounds"] == rounds
    assert len(json.loads(get(base + "api/v1/peers")[2])) == peers
    rounds = json.loads(get(base + "api/v1/rounds")[2])
    assert rounds and any(r["mean_loss"] is not None for r in rounds)
    credits = json.loads(get(base + "api/v1/credits")[2])
    assert credits["leaderboard"] and all(c["flops"] > 0 for c in credits["leaderboard"])
    assert "/api/v1/status" in json.loads(get(base + "openapi.json")[2])["paths"]
    _, content_type, metrics = get(base + "metrics")
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert {"swarmtrain_peers_online", "swarmtrain_round", "swarmtrain_credited_samples"} <= set(families)
    latest = {name: families[name].samples[0].value for name in ROUND_GAUGES}
    assert latest == {
        "swarmtrain_round_groups": 1,
        "swarmtrain_round_states": 1,
        "swarmtrain_round_peers_averaged": 3,
        "swarmtrain_rounds_split": 0,
    }
    _, content_type, page = get(base)
    assert content_type.startswith("text/html") and "loss-chart" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no assets from elsewhere (CDNs)
    with pytest.raises(urllib.error.HTTPError) as bad:
        get(base + "api/v1/rounds?limit=-5")
    assert bad.value.code == 422
