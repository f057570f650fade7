"""``swarmtrain peer`` in a terminal, as a volunteer sees it: a live progress line during each
round, one permanent line per round, and nothing but the permanent lines through a pipe."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from tests.specs import tiny_spec

REPO = Path(__file__).resolve().parents[2]
EXE = shutil.which("swarmtrain", path=str(Path(sys.executable).parent)) or "swarmtrain"
DEADLINE_S = 120.0

SPEC = tiny_spec(
    "terminal", d_model=16, context=16, inner_steps=30, overlap=None, matchmaking_timeout_s=2.0,
    allreduce_timeout_s=5.0,
)  # fmt: skip


def run_peer(tmp_path: Path, *, terminal: bool) -> tuple[int, str]:
    """A lone peer for 2 rounds (nobody to average with: both rounds fail after matchmaking)."""
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    argv = [
        EXE,
        "peer",
        "--spec",
        str(spec),
        "--key",
        str(tmp_path / "peer.key"),
        "--max-rounds",
        "2",
        "--wait-for-group",
        "0",
        "--host",
        "127.0.0.1",
    ]
    stderr = (tmp_path / "stderr.txt").open("w")
    if not terminal:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            cwd=REPO,
        )
        try:
            out, _ = proc.communicate(timeout=DEADLINE_S)
        finally:
            _reap(proc)
            stderr.close()
        return proc.returncode, out
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=stderr, start_new_session=True, cwd=REPO
    )
    os.close(follower)
    chunks: list[bytes] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the peer closed its side of the terminal
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _reap(proc)
        os.close(leader)
        stderr.close()
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace")


def _reap(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """Ends the session this test started (the peer and its hivemind children), by its id."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


ROUND_LINE = re.compile(r"round +\d+ \| loss \d+\.\d{4} \|.*averaging failed")


def test_a_terminal_shows_a_live_line_during_each_round(tmp_path: Path) -> None:
    code, out = run_peer(tmp_path, terminal=True)
    assert code == 0, (out, (tmp_path / "stderr.txt").read_text())
    live = [part for part in re.split(r"[\r\n]", out.replace("\x1b[K", "")) if part.startswith("round ")]
    bars = [text for text in live if re.match(r"round +0 \[[#.]{20}\] \d+/30 steps \| loss \d", text)]
    assert bars and any("30/30 steps" in text for text in bars), out
    assert any("averaging: looking for a group" in text for text in live), out
    assert all(len(text) <= 119 for text in live)
    permanent = [line for line in out.replace("\r\n", "\n").split("\n") if ROUND_LINE.search(line)]
    assert len(permanent) == 2, out
    assert "peer stopped cleanly" in out
    errors = (tmp_path / "stderr.txt").read_text()
    assert "averaging round failed" in errors and "Traceback" not in errors  # one line, not hivemind's traceback


def test_a_pipe_gets_only_the_permanent_lines(tmp_path: Path) -> None:
    code, out = run_peer(tmp_path, terminal=False)
    assert code == 0, (out, (tmp_path / "stderr.txt").read_text())
    assert "\r" not in out and "\x1b" not in out and "[#" not in out
    assert len([line for line in out.splitlines() if ROUND_LINE.search(line)]) == 2, out
