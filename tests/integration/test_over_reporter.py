"""A real coordinator process, two real peer processes and one cheating peer (in this
process: a real Trainer in the same swarm whose coordinator link inflates every report
tenfold, its own group weight included). The coordinator grants the cheater only what the
other members of its groups attest, and says why."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.codecs import get_codec
from peer.link.coordinator_client import CoordinatorClient, JoinAs
from peer.link.coordinator_link import CoordinatorLink
from peer.round.round_metrics import RoundMetrics
from peer.round.trainer import Trainer, TrainerOptions
from peer.swarm.swarm import Swarm
from peer.task import build_task
from protocol.identity import Identity
from protocol.spec import parse_spec
from swarmtrain.localswarm import LocalCoordinator, start_peers, wait_all, wait_until
from tests.specs import tiny_spec

SPEC = tiny_spec("cheat", min_group_size=3, extra="[credits]\nmax_samples_per_second = 100000.0\n")
ROUNDS, INFLATE = 4, 10


class InflatingLink(CoordinatorLink):
    """Reports ``INFLATE`` times the samples this peer processed, and that weight for itself."""

    def __init__(self, me: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.me = me

    def report(self, metrics: RoundMetrics) -> None:
        members = [replace(m, samples=m.samples * INFLATE) if m.id == self.me else m for m in metrics.members]
        super().report(replace(metrics, samples=metrics.samples * INFLATE, members=members))


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=10) as response:
        return json.loads(response.read())


def test_over_reporter_is_granted_only_what_its_group_attests(tmp_path: Path, server_db_url: str) -> None:
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(SPEC)
    coordinator = LocalCoordinator(spec_path, tmp_path / "state", db_url=server_db_url, extra=["--archive-every", "0"])
    peers = []
    swarm = link = None
    try:
        address, base = coordinator.address(), coordinator.http()
        cheater = Identity.generate()
        client = CoordinatorClient(address, cheater, software_version="cheat")
        joined = client.join()
        spec = parse_spec(joined.spec_toml)
        task = build_task(spec, shard_seed=7)
        numel = sum(p.numel() for p in task.model.parameters())
        swarm = Swarm(
            spec,
            numel,
            get_codec(spec.averaging.compression),
            initial_peers=list(joined.bootstrap_maddrs),
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
        rejoin = JoinAs(libp2p_peer_id=str(swarm.dht.peer_id), maddrs=tuple(swarm.visible_maddrs), reachable=True)
        admitted = client.join_as(rejoin)
        swarm.publish_membership(admitted.access_token)  # admitted: it may average
        link = InflatingLink(cheater.public_key.id, client, interval_s=joined.heartbeat_interval_s, rejoin=rejoin)
        link.start()
        peers = start_peers(spec_path, 2, tmp_path, extra=["--max-rounds", str(ROUNDS)], coordinator=address)
        trainer = Trainer(spec, task, swarm, TrainerOptions(identity=cheater, max_rounds=ROUNDS), on_round=link.report)
        thread = threading.Thread(target=trainer.run, daemon=True)
        thread.start()
        for peer, code in zip(peers, wait_all(peers, 240)):
            assert code == 0, "\n".join(peer.lines[-20:])
        thread.join(timeout=120)
        assert not thread.is_alive()
        link.stop()
        link = None
        full_rounds = [row for row in trainer.history if row.averaged and row.group_size == 3]
        assert full_rounds, trainer.history
        real = trainer.history[0].samples  # every peer runs the same batch size and steps

        def decided() -> bool:
            claims = get(base, "api/v1/credits")["by_peer"]
            return cheater.public_key.id in claims and claims[cheater.public_key.id]["rounds"] >= len(full_rounds)

        wait_until(decided, 120, "the cheater's claims to be decided")
        by_peer = get(base, "api/v1/credits")["by_peer"]
        mine = by_peer[cheater.public_key.id]
        assert mine["samples"] == real * mine["rounds"], mine  # what the group saw, not 10x
        honest = [v for k, v in by_peer.items() if k != cheater.public_key.id]
        assert honest and all(v["samples"] == real * v["rounds"] for v in honest)
    finally:
        if link is not None:
            link.stop()
        for peer in peers:
            peer.kill()
        if swarm is not None:
            swarm.shutdown()
        coordinator.kill()
