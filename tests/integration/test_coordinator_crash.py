"""The coordinator SIGKILLed mid-run: peers keep training; after a restart on the same state
directory no granted credit is missing, peers re-join by themselves and new rounds are
recorded."""

from __future__ import annotations

import socket
from pathlib import Path

from coordinator.store import Store
from swarmtrain.localswarm import LocalPeer
from tests.integration.test_coordinator_swarm import SPEC, CoordinatorProcess, status, wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def granted(store: Store) -> set[tuple[str, int]]:
    return {(c["key"], c["round"]) for c in store.claims(limit=100_000) if c["status"] == "granted"}


def test_coordinator_crash_loses_no_credit(tmp_path: Path, db_url: str) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(mode="open", allowlist="").replace("min_group_size = 3", "min_group_size = 2"))
    state = tmp_path / "state"
    port = free_port()
    address = f"127.0.0.1:{port}"
    coordinator = CoordinatorProcess(spec, state, db_url, grpc_port=port)
    peers: list[LocalPeer] = []
    try:
        coordinator.address()
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
                "500",
            ]
            peers.append(LocalPeer(args, tmp_path, f"peer{i}"))
        store = Store(db_url)
        wait_for(lambda: len(granted(store)) >= 6, 240, "some credits granted")
        coordinator.kill()
        before = granted(store)
        rounds_before = max(r["round"] for r in store.rounds())
        store.close()

        at_kill = [len(p.rounds()) for p in peers]
        wait_for(
            lambda: all(len(p.rounds()) >= n + 2 for p, n in zip(peers, at_kill)),
            120,
            "peers to train on without the coordinator",
        )

        coordinator = CoordinatorProcess(spec, state, db_url, grpc_port=port)
        coordinator.address()
        store = Store(db_url)
        wait_for(lambda: status(address).get("peers_online", 0) == 3, 120, "peers to re-join")
        wait_for(lambda: max(r["round"] for r in store.rounds()) > rounds_before + 1, 180, "new rounds recorded")
        after = granted(store)
        assert before <= after, before - after
        assert integrity_ok(store)
        store.close()
        for peer in peers:
            peer.stop(grace_s=90)
            assert peer.proc.returncode == 0, "\n".join(peer.lines[-20:])
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()


def integrity_ok(store: Store) -> bool:
    """SQLite's own check of the file; PostgreSQL keeps its own WAL (nothing to check here)."""
    if store.engine.dialect.name != "sqlite":
        return True
    with store.engine.connect() as conn:
        return conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
