"""A pair averages while its coordinator is down, one member is SIGKILLed, the coordinator
comes back and the killed member is started again with its checkpoint directory: every round
the pair averaged during the outage is credited to both (``peer.link.report_outbox``). Before, a
report waited in memory for the next heartbeat the coordinator answered and died with its
peer; the pair's survivor then reported alone, and one member's say-so credits nobody, so
neither was credited for those rounds (the 1,200-failure soak's lost credit).

And a member killed while it lands a round (its group's all-reduce done, its report not yet
written): started again, it finishes that round's report once it holds the round's state, so
its partner has its witness (``ReportOutbox.start``/``holds``). Before, that round credited
neither: the soak's largest loss, 16,048 of 21,288 samples on SQLite."""

from __future__ import annotations

import sys
from pathlib import Path

from coordinator.store import Store
from peer.link.report_outbox import OUTBOX_DIR
from swarmtrain.localswarm import LocalCoordinator, LocalPeer, wait_until
from tests.ports import free_ports
from tests.specs import tiny_spec

SPEC = tiny_spec("outbox", context=16)
OUTAGE_ROUNDS = 3
"""Rounds the pair averages while its coordinator is down (at least)."""
DIES_AT = 3
"""The round the member killed while landing was landing."""


def test_a_peer_killed_during_an_outage_is_credited_with_its_partner_once_both_are_back(
    tmp_path: Path, server_db_url: str
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    (port,) = free_ports(1)
    address, state = f"127.0.0.1:{port}", tmp_path / "state"
    outbox = tmp_path / "c1" / OUTBOX_DIR

    def peer(i: int, name: str) -> LocalPeer:
        args = ["-v", "--coordinator", address, "--host", "127.0.0.1", "--key", str(tmp_path / f"k{i}")]
        args += ["--shard-seed", str(i), "--max-rounds", "1000000", "--checkpoint-dir", str(tmp_path / f"c{i}")]
        return LocalPeer(args, tmp_path, name)

    def coordinator() -> LocalCoordinator:
        started = LocalCoordinator(
            spec, state, db_url=server_db_url, grpc_port=port, extra=["--archive-every", "0"], host="127.0.0.1"
        )
        started.address()
        return started

    running = coordinator()
    peers = [peer(0, "a"), peer(1, "b")]
    restarted: LocalPeer | None = None
    try:
        keys = [p.node_id() for p in peers]
        wait_until(lambda: all(any(r["averaged"] for r in p.rounds()) for p in peers), 240, "a round averaged")
        running.kill()
        at_outage = max(r["round"] for r in peers[1].rounds())
        wait_until(
            lambda: sum(r["averaged"] and r["round"] > at_outage for r in peers[1].rounds()) >= OUTAGE_ROUNDS,
            240,
            f"{OUTAGE_ROUNDS} rounds averaged during the outage",
        )
        peers[1].kill()
        pending = sorted(int(p.stem) for p in outbox.glob("*.pb"))
        averaged = {r["round"] for r in peers[1].rounds() if r["averaged"] and r["round"] > at_outage}
        # every round it averaged during the outage waits on disk
        assert averaged <= set(pending), (pending, averaged)
        running = coordinator()
        restarted = peer(1, "b-again")
        restarted.node_id()
        store = Store(server_db_url)
        try:

            def decided(key: str) -> dict[int, str]:
                return {c.round: c.status for c in store.claims(key=key, limit=100_000) if c.round in averaged}

            # the survivor reports in any case: its claims are decided at the latest a minute
            # after they arrive (the coordinator's ``finalize_after_s``)
            wait_until(
                lambda: len(decided(keys[0])) == len(averaged) and "pending" not in decided(keys[0]).values(),
                180,
                "the survivor's claims for the outage's rounds decided",
            )
            for key in keys:
                assert decided(key) == dict.fromkeys(averaged, "granted"), (key, decided(key))
            assert not list(outbox.glob("*.pb")), "the coordinator took them all: none left"
        finally:
            store.close()
        restarted.stop(grace_s=60)
        peers[0].stop(grace_s=60)
    finally:
        for child in [*peers, *([restarted] if restarted else []), running]:
            child.kill()


def test_a_member_killed_while_landing_finishes_its_report_when_it_is_back(tmp_path: Path, server_db_url: str) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    (port,) = free_ports(1)
    running = LocalCoordinator(
        spec, tmp_path / "state", db_url=server_db_url, grpc_port=port, extra=["--archive-every", "0"], host="127.0.0.1"
    )
    running.address()
    address = f"127.0.0.1:{port}"

    def peer(i: int, name: str, executable: list[str] | None = None) -> LocalPeer:
        args = ["-v", "--coordinator", address, "--host", "127.0.0.1", "--key", str(tmp_path / f"k{i}")]
        args += ["--shard-seed", str(i), "--max-rounds", "1000000", "--checkpoint-dir", str(tmp_path / f"c{i}")]
        return LocalPeer(args, tmp_path, name, executable=executable)

    dies = [sys.executable, "-m", "tests.integration.dies_landing", str(DIES_AT)]
    peers = [peer(0, "a"), peer(1, "b", executable=dies)]
    restarted: LocalPeer | None = None
    store = Store(server_db_url)
    try:
        keys = [p.node_id() for p in peers]
        assert peers[1].wait(240) != 0, "it killed itself as it began to land"
        assert DIES_AT not in {r["round"] for r in peers[1].rounds()}, "it recorded nothing of that round"
        unfinished = tmp_path / "c1" / OUTBOX_DIR / f"{DIES_AT:012d}.landing"
        assert unfinished.exists(), sorted(p.name for p in unfinished.parent.iterdir())
        wait_until(lambda: any(r["averaged"] and r["round"] == DIES_AT for r in peers[0].rounds()), 120, "a landed it")
        restarted = peer(1, "b-again")

        def decided() -> dict[str, str]:
            return {c.key: c.status for c in store.claims(round=DIES_AT, limit=100)}

        wait_until(lambda: "pending" not in decided().values() and len(decided()) == 2, 180, "both claims decided")
        assert decided() == dict.fromkeys(keys, "granted"), decided()
        assert not unfinished.exists()
        restarted.stop(grace_s=60)
        peers[0].stop(grace_s=60)
    finally:
        store.close()
        for child in [*peers, *([restarted] if restarted else []), running]:
            child.kill()
