"""Authorized averaging: a peer that knows the run and reaches its DHT, but holds no token from
the run's coordinator, never averages with the admitted peers nor downloads their state."""

from __future__ import annotations

from pathlib import Path

from swarmtrain.localswarm import LocalCoordinator, LocalPeer
from swarmtrain.localswarm import wait_until as wait_for
from tests.specs import tiny_spec

SPEC = tiny_spec("gated", inner_steps=30, compression="fp16")


def test_a_peer_without_a_token_cannot_average_or_download(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    coordinator = LocalCoordinator(spec, tmp_path / "state", extra=["--archive-every", "0"])
    peers: list[LocalPeer] = []
    try:
        address = coordinator.address()
        dht_maddr = coordinator.printed(r"^dht: (\S+)$", 60)
        for i in range(2):
            args = [
                "--coordinator",
                address,
                "--host",
                "127.0.0.1",
                "--key",
                str(tmp_path / f"k{i}"),
                "--shard-seed",
                str(i),
            ]
            peers.append(LocalPeer(args, tmp_path, f"peer{i}"))

        def refusals() -> list[str]:
            return [line for p in peers[:2] for line in list(p.lines) if "not admitted to this run" in line]

        wait_for(lambda: all(len(p.rounds()) >= 1 for p in peers), 180, "the admitted peers to train")
        # same spec, same DHT, no coordinator: it finds the run's peers but has no token
        intruder = LocalPeer(
            [
                "--spec",
                str(spec),
                "--host",
                "127.0.0.1",
                "--key",
                str(tmp_path / "intruder"),
                "--initial-peers",
                dht_maddr,
                "--shard-seed",
                "9",
                "--wait-for-group",
                "0",
            ],
            tmp_path,
            "intruder",
        )
        peers.append(intruder)
        # it meets the swarm at a round it aims for from the records (an open-run newcomer's way):
        # the admitted peers turn it away there (or refuse its download), however many tries it takes
        wait_for(
            lambda: len(intruder.rounds()) >= 2 and refusals(), 240, "the admitted peers to turn the intruder away"
        )
        mark = [len(p.rounds()) for p in peers[:2]]
        wait_for(
            lambda: all(len(p.rounds()) >= n + 2 for p, n in zip(peers[:2], mark)),
            120,
            "the admitted peers to go on training",
        )
        for peer in peers:
            peer.stop(grace_s=90)
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()

    intruder_rows = intruder.rounds()
    assert intruder_rows and not any(r["averaged"] for r in intruder_rows), intruder_rows
    intruder_key = next(line.split()[1] for line in intruder.lines if line.startswith("peer "))
    for peer in peers[:2]:
        rows = [r for r in peer.rounds() if r["averaged"]]
        assert len(rows) >= 3
        members = {m["id"] for r in rows for m in r.get("members", [])}
        assert intruder_key not in members
        assert all(r["group_size"] == 2 for r in rows)
    assert refusals(), "the admitted peers never turned the intruder away"
