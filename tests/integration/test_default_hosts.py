"""The README's coordinator flow with every default: the coordinator and the peers listen on
all interfaces (no --host), the peers join at 127.0.0.1, and they average every round.

On a machine with a non-loopback interface the coordinator hands out one DHT address per
interface; peers once bootstrapped from all of them and, when libp2p connected over an address
it deems unroutable (this machine's 192.0.2.2, a documentation range), the coordinator could not
route peers to each other and no round found a group (peer.swarm.bootstrap)."""

from __future__ import annotations

from pathlib import Path

from swarmtrain.localswarm import LocalCoordinator, LocalPeer, wait_all, wait_until
from tests.specs import tiny_spec

SPEC = tiny_spec("hosts", context=16)
ROUNDS = 4


def test_coordinator_and_peers_with_default_hosts_average_every_round(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    coordinator = LocalCoordinator(spec, tmp_path / "state", extra=["--archive-every", "0"])
    peers: list[LocalPeer] = []
    try:
        address = coordinator.address()
        assert address.startswith("127.0.0.1:")
        coordinator.printed(r"^(peers join with: .*)$", 60)
        dht = [line.split()[1] for line in coordinator.lines if line.startswith("dht: ")]
        assert any(maddr.startswith("/ip4/127.0.0.1/") for maddr in dht), dht
        for i in range(2):
            args = ["--coordinator", address, "--key", str(tmp_path / f"k{i}"), "--max-rounds", str(ROUNDS)]
            peers.append(LocalPeer(args, tmp_path, f"peer{i}"))
        for peer, code in zip(peers, wait_all(peers, 240)):
            assert code == 0, "\n".join(peer.lines[-20:])
        wait_until(lambda: all(len(p.rounds()) == ROUNDS for p in peers), 10, "every round's metrics")
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()
    for peer in peers:
        rows = peer.rounds()
        assert [r["averaged"] for r in rows] == [True] * ROUNDS, (peer.name, rows)
        assert all(r["group_size"] == 2 and r["in_sync"] for r in rows), rows
    assert [r["state_digest"] for r in peers[0].rounds()] == [r["state_digest"] for r in peers[1].rounds()]
