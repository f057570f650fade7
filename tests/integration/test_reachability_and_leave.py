"""A peer that accepts no inbound connections (client mode) still trains and contributes;
SIGINT/SIGTERM make a peer leave cleanly with exit status 0, whenever they arrive."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarmtrain.localswarm import LocalCoordinator, LocalPeer, wait_all
from swarmtrain.localswarm import wait_until as wait_for
from tests.specs import tiny_spec

SPEC = tiny_spec("reach", compression="fp16", min_group_size="{min_group}")


def start(tmp_path: Path, i: int, spec: Path, extra: list[str]) -> LocalPeer:
    args = ["--spec", str(spec), "--host", "127.0.0.1", "--key", str(tmp_path / f"k{i}"), "--shard-seed", str(i)]
    return LocalPeer(args + extra, tmp_path, f"peer{i}")


def test_client_mode_peer_contributes(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=3))
    peers = [start(tmp_path, 0, spec, ["--max-rounds", "3"])]
    try:
        maddr = peers[0].wait_for_maddr()
        peers.append(start(tmp_path, 1, spec, ["--max-rounds", "3", "--initial-peers", maddr]))
        peers.append(start(tmp_path, 2, spec, ["--max-rounds", "3", "--client-mode", "--initial-peers", maddr]))
        for peer, code in zip(peers, wait_all(peers, 240)):
            assert code == 0, "\n".join(peer.lines[-20:])
    finally:
        for peer in peers:
            peer.kill()
    assert any("client mode" in line for line in peers[2].lines)
    client_rows = [r for r in peers[2].rounds() if r["averaged"]]
    assert client_rows and all(r["group_size"] == 3 for r in client_rows)
    assert all(r["bytes_sent"] > 0 for r in client_rows)  # it sent its pseudo-gradient
    reachable = {(r["round"], r["state_digest"]) for r in peers[0].rounds() if r["averaged"]}
    assert all((r["round"], r["state_digest"]) in reachable for r in client_rows)


def test_sigint_and_sigterm_leave_cleanly(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=2))
    peers = [start(tmp_path, 0, spec, ["--max-rounds", "500"])]
    try:
        maddr = peers[0].wait_for_maddr()
        peers.append(start(tmp_path, 1, spec, ["--max-rounds", "500", "--initial-peers", maddr]))
        wait_for(lambda: all(len(p.rounds()) >= 2 for p in peers), 180, "two rounds on each peer")
        peers[1].proc.send_signal(signal.SIGINT)
        assert peers[1].wait(timeout=60) == 0, "\n".join(peers[1].lines[-20:])
        peers[0].proc.send_signal(signal.SIGTERM)
        assert peers[0].wait(timeout=90) == 0, "\n".join(peers[0].lines[-20:])
    finally:
        for peer in peers:
            peer.kill()
    for peer in peers:
        assert any("peer stopped cleanly" in line for line in peer.lines)


def _group_gone(pgid: int) -> bool:
    return not _alive_in_group(pgid)


def test_sigterm_while_starting_leaves_cleanly(tmp_path: Path) -> None:
    """SIGTERM as soon as the peer has written its new key file (torch not imported yet, no DHT
    yet): exit 0 and no hivemind child left behind in its process group."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=2))
    peer = start(tmp_path, 0, spec, ["--max-rounds", "5"])
    try:
        wait_for(lambda: (tmp_path / "k0").exists() or peer.proc.poll() is not None, 60, "the key file")
        peer.proc.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=120) == 0, "\n".join(peer.lines[-20:])
        wait_for(lambda: _group_gone(peer.proc.pid), 30, "the peer's children to exit")
    finally:
        peer.kill()
    assert any("peer stopped cleanly" in line for line in peer.lines)
    assert peer.rounds() == []


def test_a_signal_after_shutdown_does_not_change_the_exit_status() -> None:
    """Once the peer has shut down, a late SIGTERM (the interpreter has put the default handler
    back by then) must not turn exit status 0 into death by signal."""
    code = (
        "import os, signal\n"
        "from peer.cli import _hold_late_signals\n"
        "_hold_late_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert time.monotonic() - started < 60


def test_sigkill_takes_the_hivemind_children_along(tmp_path: Path) -> None:
    """`kill -9` of a peer or a coordinator (the OOM killer, say) leaves none of the processes it
    forked (hivemind's DHT and averager, their p2pd) running."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=2))
    peer = start(tmp_path, 0, spec, ["--max-rounds", "500"])
    coordinator = LocalCoordinator(spec, tmp_path / "coordinator")
    try:
        peer.wait_for_maddr()
        coordinator.address()
        for child in (peer, coordinator):
            assert not _group_gone(child.proc.pid)
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait(timeout=30)
            pid = child.proc.pid
            wait_for(lambda pid=pid: _group_gone(pid), 30, f"the {child.name}'s children to exit")
    finally:
        peer.kill()
        coordinator.kill()


def test_a_peer_killed_with_its_whole_process_group_leaves_no_shared_memory_behind(tmp_path: Path) -> None:
    """A container or systemd stop kills every process of the group at once. The averager's
    shared vector (model-sized, in RAM) must go with them, not stay in /dev/shm."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=2))
    peer = start(tmp_path, 0, spec, ["--max-rounds", "500"])
    try:
        peer.wait_for_maddr()
        pids = set(_alive_in_group(peer.proc.pid))
        assert len(pids) > 1, pids  # the peer and its hivemind children
        peer.kill()  # SIGKILL to the whole group
        wait_for(lambda: _group_gone(peer.proc.pid), 30, "the peer's process group to exit")
    finally:
        peer.kill()
    named = (re.match(r"torch_(\d+)_", f.name) for f in Path("/dev/shm").iterdir())
    left = [m.string for m in named if m is not None and int(m.group(1)) in pids]
    assert not left, f"{len(left)} shared-memory files of the killed peer left in /dev/shm: {left[:5]}"


def _alive_in_group(pgid: int) -> list[int]:
    """Pids of the group ``pgid`` that are still running (zombies waiting for init do not count)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            alive.append(int(entry.name))
    return alive


def test_local_children_leave_when_their_starter_is_killed(tmp_path: Path) -> None:
    """`swarmtrain demo` (or any user of swarmtrain.localswarm) killed with SIGKILL: the peers
    it started leave by themselves, with their hivemind children."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(min_group=2))
    starter_code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from swarmtrain.localswarm import LocalPeer\n"
        f"peer = LocalPeer(['--spec', {str(spec)!r}, '--host', '127.0.0.1', '--key', {str(tmp_path / 'k0')!r}],"
        f" Path({str(tmp_path)!r}), 'peer0')\n"
        "peer.wait_for_maddr()\n"
        "print(peer.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", starter_code], stdout=subprocess.PIPE, text=True)
    peer_pid = 0
    try:
        assert starter.stdout is not None
        peer_pid = int(starter.stdout.readline())
        assert _alive_in_group(peer_pid)
        starter.kill()
        starter.wait(timeout=30)
        wait_for(lambda: not _alive_in_group(peer_pid), 60, "the orphaned peer to leave")
    finally:
        starter.kill()
        starter.wait(timeout=30)
        if peer_pid:
            try:
                os.killpg(peer_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
