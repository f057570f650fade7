"""Start `swarmtrain peer` processes on loopback and reap exactly those (by pid)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

EXE = shutil.which("swarmtrain", path=str(Path(sys.executable).parent)) or "swarmtrain"
MADDR_RE = re.compile(r"^listening: (/ip4/127\.0\.0\.1/\S+)$")


class PeerProcess:
    """One `swarmtrain peer` child; its output is collected by a thread."""

    def __init__(self, args: list[str], workdir: Path, name: str) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self.lines: list[str] = []
        # one torch thread per peer: several peers share this machine's cores
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [EXE, "peer", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)
                out.flush()

    def wait_for_maddr(self, deadline_s: float = 90.0) -> str:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = MADDR_RE.match(line)
                if match:
                    return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name} printed no loopback multiaddr:\n" + "\n".join(self.lines))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
