"""Peers started while their coordinator is down (issue #49): each says once that the
coordinator is not answering, keeps trying with backoff (``peer.link.coordinator_client.
join_when_up``), joins when it comes back after a 60 s outage, and the two average every round.
Before, a peer exited at once with a raw gRPC error."""

from __future__ import annotations

import time
from pathlib import Path

from swarmtrain.localswarm import LocalCoordinator, LocalPeer, wait_all, wait_until
from tests.ports import free_ports
from tests.specs import tiny_spec

SPEC = tiny_spec("outage", context=16)
OUTAGE_S = 60.0
ROUNDS = 2


def test_peers_started_during_a_coordinator_outage_join_when_it_returns(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    down_since = time.monotonic()
    peers = [
        LocalPeer(
            ["--coordinator", address, "--key", str(tmp_path / f"k{i}"), "--shard-seed", str(i)]
            + ["--max-rounds", str(ROUNDS), "--checkpoint-dir", str(tmp_path / f"c{i}")],
            tmp_path,
            f"peer{i}",
        )
        for i in range(2)
    ]
    coordinator: LocalCoordinator | None = None
    try:
        for peer in peers:
            peer.printed(r"^(coordinator \S+ is not answering .*)$", 60)
        # the outage lasts; the peers wait (polled: one that exited fails the test at once)
        wait_until(
            lambda: any(peer.proc.poll() is not None for peer in peers) or time.monotonic() - down_since >= OUTAGE_S,
            OUTAGE_S + 30,
            "the outage's end",
        )
        assert all(peer.proc.poll() is None for peer in peers), [peer.lines[-10:] for peer in peers]
        coordinator = LocalCoordinator(spec, tmp_path / "state", grpc_port=port, extra=["--archive-every", "0"])
        for peer in peers:
            # backoff at most 30 s apart: back within that of the coordinator's return
            peer.printed(r"^coordinator \S+ (answered after \d+ s)$", 90)
        for peer, code in zip(peers, wait_all(peers, 240)):
            assert code == 0, "\n".join(peer.lines[-20:])
        wait_until(lambda: all(len(p.rounds()) == ROUNDS for p in peers), 10, "every round's metrics")
    finally:
        for peer in peers:
            peer.kill()
        if coordinator is not None:
            coordinator.kill()
    for peer in peers:
        said = [line for line in peer.lines if "is not answering" in line]
        assert len(said) == 1, said  # one line, not one per attempt
        rows = peer.rounds()
        assert [r["averaged"] for r in rows] == [True] * ROUNDS, (peer.name, rows)
    assert [r["state_digest"] for r in peers[0].rounds()] == [r["state_digest"] for r in peers[1].rounds()]
