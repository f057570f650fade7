"""A Python child process running a program text, for the kill -9 tests: its output lines are
read on a thread as they come, so a test can act on a line (kill the child right then) and
still see every line the child printed before it died."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class ProgramChild:
    """``python -c PROGRAM ARGS...`` with the repository on its path; ``lines`` holds what it
    printed so far (read with ``next_line``)."""

    def __init__(self, python: str, repo_root: Path, program: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", program, *args],
            cwd=repo_root,
            env={**os.environ, "PYTHONPATH": str(repo_root)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=_pump, args=(self.proc.stdout, self._queue), daemon=True)
        self._reader.start()
        self.lines: list[str] = []

    def next_line(self, deadline: float) -> str:
        """The next line it prints, waiting until ``deadline`` (``time.monotonic``); fails the
        test if it exits or stays silent until then."""
        remaining = deadline - time.monotonic()
        try:
            line = self._queue.get(timeout=max(0.0, remaining))
        except queue.Empty:
            raise AssertionError(f"child silent until the deadline: {self.lines[-5:]}") from None
        assert line is not None, f"child exited (rc {self.proc.poll()}): {''.join(self.lines[-20:])}"
        self.lines.append(line)
        return line

    def kill9(self) -> None:
        """SIGKILL it, reap it, and collect the lines it printed before it died."""
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
            assert self.proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            self.reap()

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.lines.append(line)
