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
from typing import Any

from swarmtrain.localswarm import LocalPeer, start_peers, wait_all
from tests.specs import tiny_spec

SPEC = tiny_spec("leave", context=16, matchmaking_timeout_s=15.0)
ROUNDS = 20
"""Rounds the two members that stay train (the others leave or die well before)."""
LEAVER_ROUNDS = 3
KILL_AT = LEAVER_ROUNDS + 3
"""The doomed member is killed once it has landed a round this late (after the leave)."""


def _wait(done: Any, deadline_s: float, what: str, peer: LocalPeer) -> None:
    end = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < end, f"{what}:\n" + "\n".join(peer.lines[-20:])
        assert peer.proc.poll() is None, f"{peer.name} exited before {what}:\n" + "\n".join(peer.lines[-20:])
        time.sleep(0.05)


def test_a_clean_leave_and_a_death_cost_the_next_round_no_window(tmp_path: Path) -> None:
    """One swarm of four: peer2 leaves cleanly after its third round, then peer3 is SIGKILLed
    with its process group (a lost machine); peers 0 and 1 train on. The round after the leave
    closes counting the leaver as gone (its ``leaving`` record), the round after the death
    counting the silent member as gone (its leader's probe), neither waiting out the window."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    # -v: the leader's averager logs how it closed its group
    peers: list[LocalPeer] = start_peers(spec, 2, tmp_path, extra=["--max-rounds", str(ROUNDS), "-v"])
    others: list[LocalPeer] = []
    try:
        address = peers[0].wait_for_maddr()
        for index, limit in ((2, ["--max-rounds", str(LEAVER_ROUNDS)]), (3, [])):
            others.append(
                LocalPeer(
                    ["--spec", str(spec), "--key", str(tmp_path / f"peer{index}.key"), "--shard-seed", str(index)]
                    + [*limit, "-v", "--initial-peers", address],
                    tmp_path,
                    f"peer{index}",
                )
            )
        leaver, doomed = others
        _wait(lambda: any(row["round"] >= KILL_AT for row in doomed.rounds()), 240, "its round after the leave", doomed)
        doomed.kill()  # the peer and its DHT, averager and p2pd processes: a lost machine
        killed = time.time()
        for peer, code in zip([*peers, leaver], wait_all([*peers, leaver], 300)):
            assert code == 0, "\n".join(peer.lines[-20:])
    finally:
        for peer in [*peers, *others]:
            peer.kill()
    left_at = leaver.rounds()[-1]["round"] + 1  # the round of the state it left holding
    for peer in peers:
        rows = peer.rounds()
        # the kill may come mid-all-reduce (rounds of tiny phases): that attempt fails, no more
        after_kill = [row for row in rows if row["at"] > killed]
        landed = [row for row in after_kill if row["averaged"]]
        assert landed and len(after_kill) - len(landed) <= 1, after_kill
        assert all(row["averaged"] for row in rows if row["at"] <= killed), rows
        assert any(row["group_size"] == 4 for row in rows), rows
        after_leave = [row for row in rows if row["round"] == left_at]
        assert after_leave and after_leave[0]["group_size"] == 3, rows
        first = landed[0]
        assert first["group_size"] == 2 and first["in_sync"], first
        normal = statistics.median(row["wall_s"] for row in rows if row["round"] not in (0, left_at, first["round"]))
        print(
            f"{peer.name}: round {left_at} (after the leave) {after_leave[0]['wall_s']:.2f} s, first round after "
            f"the death {first['wall_s']:.2f} s, the others' median {normal:.2f} s"
        )
    # whoever led the round logs it: the doomed member led the round after the leave once
    lines = [line for peer in [*peers, *others] for line in peer.lines]
    assert any("more left cleanly" in line for line in lines), "no leader closed its group counting the leaver"
    assert any("more did not answer" in line for line in lines), "no leader closed counting the dead member gone"
    assert any("leaves holding round" in line for line in leaver.lines), leaver.lines[-20:]
