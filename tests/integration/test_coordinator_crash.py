"""The coordinator SIGKILLed again and again mid-run (and a peer with it): peers keep training;
after each restart on the same state directory no granted credit is missing, the database
passes its integrity check, killed peers resume from their checkpoints, peers re-join by
themselves and new rounds are recorded (issue #14's crash loop)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from coordinator.store import Store
from engine.checkpoint import Checkpointer
from protocol.spec import parse_spec
from swarmtrain.localswarm import LocalCoordinator, LocalPeer
from swarmtrain.localswarm import wait_until as wait_for
from tests.integration.coordinator_status import status
from tests.ports import free_port
from tests.specs import COORDINATOR_SPEC as SPEC


def granted(store: Store) -> set[tuple[str, int]]:
    return {(c.key, c.round) for c in store.claims(limit=100_000) if c.status == "granted"}


COORDINATOR_KILLS = 5
PEER_KILLS = 2
MAX_ROUNDS = 1_000_000
"""More than the peers land before the test stops them (it does, at its end): this spec's rounds
take about 0.07 s, and a loaded run's kills and restarts took long enough for 500 rounds to run
out before the last restart's peers could re-join."""


def test_coordinator_crash_loop_loses_no_credit(tmp_path: Path, db_url: str) -> None:
    """The coordinator SIGKILLed ``COORDINATOR_KILLS`` times at seeded random moments, and one
    peer ``PEER_KILLS`` times, while three peers train: after each restart no granted credit is
    missing and the database passes its integrity check; a killed peer resumes from a
    checkpoint that loads; at the end peers re-join and new rounds are recorded."""
    rng = random.Random(1414)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(mode="open", allowlist="").replace("min_group_size = 3", "min_group_size = 2"))
    state = tmp_path / "state"
    port = free_port()
    address = f"127.0.0.1:{port}"
    coordinator = LocalCoordinator(spec, state, db_url=db_url, grpc_port=port)
    peers: list[LocalPeer] = []
    lives = [0, 0, 0]

    def start_peer(i: int) -> LocalPeer:
        args = [
            "-v",
            "--coordinator",
            address,
            "--host",
            "127.0.0.1",
            "--key",
            str(tmp_path / f"k{i}"),
            "--shard-seed",
            str(i),
            "--max-rounds",
            str(MAX_ROUNDS),
            "--checkpoint-dir",
            str(tmp_path / f"ckpt{i}"),
        ]
        lives[i] += 1
        return LocalPeer(args, tmp_path, f"peer{i}-life{lives[i]}")

    granted_so_far: set[tuple[str, int]] = set()
    began = time.monotonic()

    def phase(what: str) -> None:  # each step's time, in the report of a failure
        print(f"{time.monotonic() - began:6.1f} s  {what}", flush=True)

    def check_store() -> None:
        store = Store(db_url)
        try:
            now_granted = granted(store)
            assert granted_so_far <= now_granted, granted_so_far - now_granted
            granted_so_far.update(now_granted)
            assert integrity_ok(store)
        finally:
            store.close()

    try:
        coordinator.address()
        phase("coordinator up")
        peers.extend(start_peer(i) for i in range(3))
        store = Store(db_url)
        wait_for(lambda: len(granted(store)) >= 6, 240, "some credits granted")
        store.close()
        phase("6 credits granted")
        peer_kills_at = set(rng.sample(range(COORDINATOR_KILLS), PEER_KILLS))
        for kill in range(COORDINATOR_KILLS):
            time.sleep(rng.uniform(0.0, 3.0))  # the kill's moment: seeded random, not a wait for anything
            coordinator.kill()
            check_store()
            phase(f"kill {kill}: store checked")
            if kill == 0:  # peers train on without the coordinator
                at_kill = [len(p.rounds()) for p in peers]
                wait_for(
                    lambda: all(len(p.rounds()) >= n + 2 for p, n in zip(peers, at_kill)),  # noqa: B023
                    120,
                    "peers to train on without the coordinator",
                )
                phase("peers trained on")
            if kill in peer_kills_at:  # peer 2 dies too, at whatever it was doing (a checkpoint write, ...)
                peers[2].kill()
                loaded = Checkpointer(tmp_path / "ckpt2", spec_digest=spec_digest(spec)).latest()
                assert loaded is not None, "a killed peer's checkpoints do not load"
            coordinator = LocalCoordinator(spec, state, db_url=db_url, grpc_port=port)
            coordinator.address()
            phase(f"kill {kill}: coordinator restarted")
            if kill in peer_kills_at:  # (a peer starting needs its coordinator)
                peers[2] = start_peer(2)
        restarted = peers[2]
        wait_for(
            lambda: any("resumed from the checkpoint of round" in line for line in restarted.lines),
            120,
            "the killed peer to resume from its checkpoint",
        )
        phase("peer resumed")
        store = Store(db_url)
        rounds_before = max(r.round for r in store.rounds())
        wait_for(lambda: status(address).get("peers_online", 0) == 3, 120, "peers to re-join")
        phase("peers re-joined")
        wait_for(lambda: max(r.round for r in store.rounds()) > rounds_before + 1, 180, "new rounds recorded")
        phase("new rounds recorded")
        store.close()
        check_store()
        for peer in peers:
            peer.stop(grace_s=90)
            assert peer.proc.returncode == 0, "\n".join(peer.lines[-20:])
        phase("peers stopped")
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()
    print(f"{COORDINATOR_KILLS} coordinator kills, {PEER_KILLS} peer kills, 0 losses")


def spec_digest(path: Path) -> str:
    return parse_spec(path.read_text()).digest()


def integrity_ok(store: Store) -> bool:
    """SQLite's own check of the file; PostgreSQL keeps its own WAL (nothing to check here)."""
    if store.engine.dialect.name != "sqlite":
        return True
    with store.engine.connect() as conn:
        return conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
