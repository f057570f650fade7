"""One swarm, one state: 10 real peers (more than the old default group of 8) average in one
group per round, while one of them is SIGKILLed mid-round and a late joiner comes in. Every
round, all members that averaged hold one digest; no peer is out of sync for more than one
round; at least 90% of the peer-rounds averaged (``protocol.roster``, ``engine.matchmaking``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from swarmtrain.localswarm import LocalPeer, start_peers, wait_until
from tests.specs import tiny_spec

PEERS, LATE_ROUNDS = 10, 3
ROUNDS = 500  # the others train on until the late joiner is done, then leave (SIGTERM)
SPEC = tiny_spec(
    "one-swarm", lr=3e-3, inner_steps=4, overlap=None, matchmaking_timeout_s=10.0, allreduce_timeout_s=60.0
)


def _summary(histories: dict[str, list[dict]]) -> str:
    return "\n".join(
        f"{name}: " + " ".join(f"r{r['round']}:{r['group_size']}{'' if r['in_sync'] else '!'}" for r in rows)
        for name, rows in histories.items()
    )


def test_ten_peers_one_state_per_round_through_a_kill_and_a_late_join(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    peers = start_peers(spec, PEERS, tmp_path, extra=["-v", "--max-rounds", str(ROUNDS), "--host", "127.0.0.1"])
    late: LocalPeer | None = None
    try:
        victim = peers[-1]
        # kill it once it has averaged two rounds and launched its next one
        wait_until(lambda: len(victim.rounds()) >= 2, 240, "the victim to average 2 rounds")
        wait_until(
            lambda: sum("averaging round " in line for line in victim.lines) >= 3, 120, "the victim to launch again"
        )
        victim.kill()
        late_args = ["-v", "--spec", str(spec), "--key", str(tmp_path / "late.key"), "--host", "127.0.0.1"]
        late_args += ["--initial-peers", peers[0].wait_for_maddr(), "--max-rounds", str(LATE_ROUNDS)]
        late = LocalPeer(late_args, tmp_path, "late")
        assert late.wait(timeout=240) == 0, "\n".join(late.lines[-30:])
        for peer in peers[:-1]:
            peer.leave()  # all at once: each finishes the round in flight, then exits
        for peer in peers[:-1]:
            peer.stop(grace_s=90)
            assert peer.proc.returncode == 0, "\n".join(peer.lines[-30:])
    finally:
        for peer in [*peers, *([late] if late else [])]:
            peer.kill()

    histories = {f"peer{i}": peer.rounds() for i, peer in enumerate(peers[:-1])}
    histories["late"] = late.rounds()
    report = _summary(histories)
    assert len(histories["late"]) == LATE_ROUNDS, report
    assert any("adopted the swarm's state of round" in line for line in late.lines), report
    by_round: dict[int, set[str]] = defaultdict(set)
    for rows in histories.values():
        for row in rows:
            if row["averaged"]:
                by_round[row["round"]].add(row["state_digest"])
    # every round, the members that averaged hold one state
    assert all(len(digests) == 1 for digests in by_round.values()), (dict(by_round), report)
    # nobody is out of sync for more than one round
    for name, rows in histories.items():
        flags = [row["in_sync"] for row in rows]
        assert not any(not a and not b for a, b in zip(flags, flags[1:])), (name, report)
    # at least 90% of the peer-rounds averaged (more members than the old default group of 8)
    rows = [row for history in histories.values() for row in history]
    averaged = sum(row["averaged"] for row in rows)
    assert averaged >= 0.9 * len(rows), (averaged, len(rows), report)
    assert max(row["group_size"] for row in rows) > 8, report
