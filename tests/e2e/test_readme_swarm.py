"""The volunteer guide's coordinator-less swarm, exactly as written, on one machine: three peers with
the default identity (one account key) and the default hosts (all interfaces). Each runs as
its own member (its own node key, endorsed by the account), and they train in sync."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from swarmtrain.localswarm import Child, swarmtrain_executable, wait_until

REPO = Path(__file__).resolve().parents[2]
ROUNDS_IN_SYNC = 3


def readme_commands() -> tuple[list[str], list[str]]:
    """The README's first peer command and its joining one (comments stripped)."""
    lines = [line.split("#")[0].split() for line in (REPO / "docs" / "volunteer.md").read_text().splitlines()]
    commands = [line for line in lines if line[:3] == ["swarmtrain", "peer", "--spec"]]
    first = next(line for line in commands if "--initial-peers" not in line)
    joining = next(line for line in commands if "--initial-peers" in line)
    return first[1:], joining[1:]


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def test_three_peers_as_the_readme_shows_train_in_sync_with_one_default_identity(tmp_path: Path) -> None:
    first, joining = readme_commands()
    home = tmp_path / "home"  # the default identity of this "user"
    env = {"SWARMTRAIN_HOME": str(home), "OMP_NUM_THREADS": "1"}
    peers: list[Child] = []
    try:
        for i in range(3):
            cwd = tmp_path / f"peer{i}"
            cwd.mkdir()
            (cwd / "examples").symlink_to(REPO / "examples")
            argv = list(first)
            if i:
                maddr = peers[0].printed(r"^listening: (\S+)", 120)
                argv = [maddr if arg == "MADDR" else arg for arg in joining]
            else:
                argv += ["--metrics-file", "rounds.jsonl"]  # to compare its digests too
            peers.append(Child(argv, tmp_path / f"peer{i}.log", f"peer{i}", env, cwd=cwd))
            if i == 0:
                peers[0].printed(r"^listening: (\S+)", 120)  # it created the default key first
        accounts = {p.printed(r"^peer \S+ of account (\S+)", 60) for p in peers}
        nodes = {p.printed(r"^peer (\S+) of account", 60) for p in peers}
        assert len(accounts) == 1 and len(nodes) == 3, (accounts, nodes)
        files = [tmp_path / f"peer{i}" / "rounds.jsonl" for i in range(3)]

        def in_sync_rounds() -> set[int]:
            by_round: dict[int, set[str]] = {}
            per_peer = [{r["round"]: r for r in rows(f) if r["averaged"] and r["in_sync"]} for f in files]
            common = set.intersection(*(set(p) for p in per_peer)) if all(per_peer) else set()
            for round_ in common:
                by_round[round_] = {p[round_]["state_digest"] for p in per_peer}
            return {r for r, digests in by_round.items() if len(digests) == 1}

        wait_until(lambda: len(in_sync_rounds()) >= ROUNDS_IN_SYNC, 240, f"{ROUNDS_IN_SYNC} rounds in sync")
        for peer in peers:  # Ctrl-C: finish the round and leave
            peer.proc.send_signal(signal.SIGINT)
        for peer in peers:
            assert peer.proc.wait(timeout=90) == 0, "\n".join(peer.lines[-20:])
        text = "\n".join(line for p in peers for line in p.lines)
        assert "another state than its group" not in text and "out of sync" not in text, text[-3000:]
        for f in files:  # every round a peer averaged ended bit-identical with the others
            for row in rows(f):
                assert row["in_sync"], row
    finally:
        for peer in peers:
            peer.kill()


def test_a_second_peer_on_the_same_checkpoint_dir_exits_at_once_saying_why(tmp_path: Path) -> None:
    spec = REPO / "examples" / "demo.toml"
    env = {"SWARMTRAIN_HOME": str(tmp_path / "home")}
    args = ["peer", "--spec", str(spec), "--checkpoint-dir", str(tmp_path / "ckpt"), "--host", "127.0.0.1"]
    first = Child(args, tmp_path / "first.log", "first", env)
    try:
        first.printed(r"^listening: (\S+)", 120)
        second = subprocess.run(
            [*swarmtrain_executable(), *args],
            capture_output=True,
            text=True,
            timeout=120,  # a hang guard: "at once" is shown by what it did not do (below)
            env={**os.environ, **env},
        )
        assert second.returncode != 0
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and re.search(r"checkpoint-dir .* in use by a running peer \(pid \d+\)", lines[0]), lines
        # it stopped before anything a peer does: no join, no model, no swarm (its stdout is empty)
        assert not second.stdout.strip(), second.stdout
    finally:
        first.kill()
