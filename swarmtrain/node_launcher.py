"""``swarmtrain peer --nproc-per-node N``: start the node's N local ranks and watch them.

Each rank is the same ``swarmtrain`` command with torchrun's environment variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on loopback), in its own
session, so a Ctrl-C in the terminal reaches only this launcher; it passes SIGINT/SIGTERM on
to rank 0 (the leader), which finishes its round, tells the other ranks to stop and leaves the
swarm. The ranks die with the launcher (``swarmtrain.lifetime``).

Every rank touches a heartbeat file from a thread every few seconds (``peer.node.node``); one
that falls silent for ``--rank-timeout`` seconds (a stopped or frozen process) is killed and
counts as lost. A rank that exits with an error, is killed or is lost so ends the node as a unit: the leader is told to
leave (its collectives with the lost rank fail, so it cannot average a half-updated state; its
checkpoints are written whole or not at all), every rank still running after a grace period
is killed, and the command exits 1 with a line naming the rank and how it ended.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from peer.node.node_env import HEARTBEAT_ENV
from protocol.ports import unassigned_port
from swarmtrain.lifetime import PARENT_ENV

logger = logging.getLogger(__name__)

DEFAULT_RANK_TIMEOUT_S = 120.0
"""A rank whose heartbeat stops this long is hung (stopped, frozen): killed, the node ends."""
GRACE_S = 30.0
"""How long the leader gets to leave the swarm once a rank is lost, before it is killed."""
WORKERS_GRACE_S = 10.0
"""How long the other ranks get to exit once the leader has."""
POLL_S = 0.2


def describe_exit(code: int) -> str:
    """``exited with status 3`` / ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for local rank ``rank`` of a one-machine node."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_WORLD_SIZE": "1",
    }


def launch(command: Sequence[str], nproc: int, *, rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S) -> int:
    """Run ``command`` (a ``swarmtrain`` argv) as ``nproc`` local ranks; the node's exit status.
    A rank whose heartbeat (``peer.node.node_env.HEARTBEAT_ENV``) stops for ``rank_timeout_s`` is hung."""
    port = unassigned_port()  # rank 0's store binds it a moment later
    beats = Path(tempfile.mkdtemp(prefix="swarmtrain-node-"))
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nproc):
        env = {**os.environ, **rank_env(rank, nproc, port), PARENT_ENV: str(os.getpid())}
        env[HEARTBEAT_ENV] = str(beats / f"rank-{rank}")
        procs.append(subprocess.Popen([sys.executable, "-m", "swarmtrain", *command], env=env, start_new_session=True))
    print(f"node: {nproc} local ranks, pids {' '.join(str(p.pid) for p in procs)}", flush=True)
    leader = procs[0]

    def forward(signum: int, frame: FrameType | None) -> None:
        if leader.poll() is None:
            leader.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs, beats, rank_timeout_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
        shutil.rmtree(beats, ignore_errors=True)


def silent_for(beat: Path, now: float) -> float:
    """Seconds since the rank's last heartbeat; 0 before its first (it is still starting)."""
    try:
        return max(0.0, now - beat.stat().st_mtime)
    except FileNotFoundError:
        return 0.0


def _watch(procs: list[subprocess.Popen[bytes]], beats: Path, rank_timeout_s: float) -> int:
    lost: tuple[int, str] | None = None
    deadline = float("inf")
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            break
        if lost is None:
            now = time.time()
            for rank, code in enumerate(codes):
                if code is not None and (code != 0 or rank == 0):
                    lost = (rank, describe_exit(code))
                    break
                silent = silent_for(beats / f"rank-{rank}", now) if code is None else 0.0
                if silent > rank_timeout_s:
                    lost = (rank, f"stopped responding (no heartbeat for {silent:.0f} s)")
                    _kill_group(procs[rank])
                    break
            if lost is not None and lost[0] != 0:
                if procs[0].poll() is None:
                    procs[0].send_signal(signal.SIGTERM)  # leave the swarm (its collectives fail anyway)
                deadline = time.monotonic() + GRACE_S
            elif lost is not None:
                deadline = time.monotonic() + WORKERS_GRACE_S  # the leader told them to stop, or is gone
        if time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
        time.sleep(POLL_S)
    exits = [proc.wait() for proc in procs]
    if lost is not None and lost[0] != 0:
        rank, how = lost
        print(f"swarmtrain peer: error: local rank {rank} {how}; the node left the swarm", file=sys.stderr)
        return 1
    leader = exits[0]
    return leader if leader >= 0 else 128 - leader


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and its process group (hivemind's children and p2pd with it); reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
