"""``benchmarks.nat_paths``'s reading of peer logs and its per-path summary: the path each
peer's ``network:`` line names, whose relay a relayed peer holds a port on, what a volunteer's
relay carried, and each peer's rounds counted from the first it averaged."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.nat_paths import _carried, _path, _relayed_via, _summary


def _log(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.log"
    path.write_text(text)
    return path


def test_the_path_and_the_relay_come_from_the_peers_own_lines(tmp_path: Path) -> None:
    relayed = _log(
        tmp_path,
        "r0",
        "model: ...\nnetwork: relayed at /ip4/10.0.0.3/tcp/41234 (the coordinator cannot reach 10.0.0.5:7700 "
        "(refused); a port on the relay of volunteer 10.0.0.3:38623)\nrelay: off (this peer is relayed, not dialled "
        "back directly)\n",
    )
    assert _path(relayed) == "relayed"
    assert _relayed_via(relayed) == "the relay of volunteer 10.0.0.3:38623"
    assert _carried(relayed) == 0
    twice = _log(
        tmp_path,
        "r1",
        "network: relayed at /ip4/10.0.0.3/tcp/41234 and /ip4/10.0.0.4/tcp/40001 (the coordinator cannot reach "
        "10.0.0.6:7700 (refused); a port on the relay of volunteer 10.0.0.3:38623 and the coordinator's relay)\n",
    )
    assert _relayed_via(twice) == "the relay of volunteer 10.0.0.3:38623 and the coordinator's relay"
    volunteer = _log(
        tmp_path,
        "d0",
        "network: direct (the coordinator reached this machine at 10.0.0.3:7700)\nrelay: serving peers nobody can "
        "dial on port 38623, granting any 8 free ports (the coordinator reached it)\nrelay: carried 36,141,508 bytes "
        "for peers nobody can dial\n",
    )
    assert _path(volunteer) == "direct" and _relayed_via(volunteer) == ""
    assert _carried(volunteer) == 36_141_508
    assert _path(tmp_path / "missing.log") == "unknown"


def test_each_peer_counts_its_rounds_from_the_first_it_averaged(tmp_path: Path) -> None:
    def rows(name: str, averaged: list[int], rounds: int) -> None:
        lines = [
            json.dumps(
                {
                    "round": r,
                    "averaged": r in averaged,
                    "group_size": 4 if r in averaged else 1,
                    "bytes_sent": 100,
                    "bytes_received": 100,
                    "allreduce_s": 1.0,
                }
            )
            for r in range(1, rounds + 1)
        ]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")

    rows("d0", list(range(1, 9)), 8)
    rows("r0", [6, 7, 8], 8)  # joined late: rounds 6-8 of the 3 since it first averaged
    rows("r1", [5, 7, 8], 8)  # missed one of the 4 since its first
    result = _summary(tmp_path, {"d0": "direct", "r0": "relayed", "r1": "relayed"}, 600.0, 8, "50mbit")
    assert result["paths"]["direct"]["peer_rounds_averaged"] == 8
    assert result["paths"]["direct"]["peer_rounds_since_in"] == 8
    assert result["paths"]["relayed"]["peer_rounds_averaged"] == 6
    assert result["paths"]["relayed"]["peer_rounds_since_in"] == 3 + 4
    assert result["relayed_share"] == 600.0 / (14 * 200 / 2)
