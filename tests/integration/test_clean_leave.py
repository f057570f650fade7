"""A clean leave costs the next round nothing (issue #49): a peer that stops cleanly (here its
last round, ``--max-rounds``; Ctrl-C and SIGTERM end the same way) marks its last digest record
``leaving`` (signed), and the next round's leader, which counts it in the roster of the state,
closes its group as soon as the others are in instead of waiting out its window for it
(``engine.matchmaking.RoundMatchmaking._watch_leaves``). Before, that round waited the whole
window (37 s in ``test_local_ranks``, minutes in a real run). The leave lowers no majority: the
round lands because 2 of its roster of 3 are in (``protocol.roster.verdict``).

A member that dies without a word (SIGKILL with its process group: a lost machine) costs the
next round no window either: its leader asks it whether it is there (``engine.liveness``), it
does not answer, and the leader closes with the others; before, that round waited the whole
window (9 s beyond an 8 s phase in ``benchmarks/churn.py``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from swarmtrain.localswarm import LocalPeer, start_peers, wait_all
from tests.integration.specs import tiny_spec

SPEC = tiny_spec("leave", context=16, matchmaking_timeout_s=15.0)
ROUNDS = 6
LEAVER_ROUNDS = 3


def test_the_round_after_a_clean_leave_does_not_wait_for_the_leaver(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    # -v: the leader's averager logs how it closed its group
    peers: list[LocalPeer] = start_peers(spec, 2, tmp_path, extra=["--max-rounds", str(ROUNDS), "-v"])
    try:
        leaver = LocalPeer(
            ["--spec", str(spec), "--key", str(tmp_path / "peer2.key"), "--shard-seed", "2"]
            + ["--max-rounds", str(LEAVER_ROUNDS), "-v", "--initial-peers", peers[0].wait_for_maddr()],
            tmp_path,
            "peer2",
        )
        peers.append(leaver)
        for peer, code in zip(peers, wait_all(peers, 300)):
            assert code == 0, "\n".join(peer.lines[-20:])
    finally:
        for peer in peers:
            peer.kill()
    left_at = leaver.rounds()[-1]["round"] + 1  # the round of the state it left holding
    for peer in peers[:2]:
        rows = peer.rounds()
        assert all(row["averaged"] for row in rows), rows
        with_it = [row for row in rows if row["group_size"] == 3]
        after = [row for row in rows if row["round"] == left_at]
        assert with_it and after and after[0]["group_size"] == 2, rows
        normal = (
            statistics.median(row["wall_s"] for row in rows if row["round"] > left_at) if left_at < ROUNDS - 1 else None
        )
        print(
            f"{peer.name}: round {left_at} (after the leave) {after[0]['wall_s']:.2f} s, later rounds' median {normal}"
        )
    led = [line for peer in peers[:2] for line in peer.lines if "more left cleanly" in line]
    assert led, "no leader closed its group counting the leaver"
    assert any("leaves holding round" in line for line in leaver.lines), leaver.lines[-20:]


KILL_AFTER = 3
"""Rows the killed member writes before it is killed."""


def test_the_round_after_a_member_dies_does_not_wait_for_it(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    peers: list[LocalPeer] = start_peers(spec, 2, tmp_path, extra=["--max-rounds", str(ROUNDS), "-v"])
    try:
        doomed = LocalPeer(
            ["--spec", str(spec), "--key", str(tmp_path / "peer2.key"), "--shard-seed", "2"]
            + ["-v", "--initial-peers", peers[0].wait_for_maddr()],
            tmp_path,
            "peer2",
        )
        deadline = time.monotonic() + 240
        while len([row for row in doomed.rounds() if row["group_size"] == 3]) < KILL_AFTER:
            assert time.monotonic() < deadline, "\n".join(doomed.lines[-20:])
            assert doomed.proc.poll() is None, "\n".join(doomed.lines[-20:])
            time.sleep(0.2)
        doomed.kill()  # the peer and its DHT, averager and p2pd processes: a lost machine
        killed = time.time()
        for peer, code in zip(peers, wait_all(peers, 300)):
            assert code == 0, "\n".join(peer.lines[-20:])
    finally:
        for peer in [*peers, *([doomed] if "doomed" in locals() else [])]:
            peer.kill()
    for peer in peers:
        rows = peer.rounds()
        # the kill may come mid-all-reduce (rounds of tiny phases): that attempt fails, no more
        after = [row for row in rows if row["at"] > killed]
        landed = [row for row in after if row["averaged"]]
        assert landed and len(after) - len(landed) <= 1, after
        first = landed[0]
        assert first["group_size"] == 2 and first["in_sync"], first
        normal = statistics.median(row["wall_s"] for row in rows if row is not first and row["round"] > 0)
        print(f"{peer.name}: first round after the death {first['wall_s']:.2f} s, the others' median {normal:.2f}")
    led = [line for peer in peers for line in peer.lines if "more did not answer" in line]
    assert led, "no leader closed its group counting the dead member as gone"
