"""The lab benchmarks' coordinator process (``benchmarks.churn``, ``benchmarks.soak``): started
in its namespace of a ``WanSim``, SIGKILLed with its children, started again on its state."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from benchmarks.netsim import WanSim
from benchmarks.slow_join import SW, wait_for

__all__ = ["LabCoordinator"]


class LabCoordinator:
    """A coordinator in host ``coord`` (gRPC 7500, DHT 7600, HTTP 8080), its state under
    ``workdir/coordinator``, its logs ``workdir/coordinator.N.log``; ``db``: a database URL (else
    its SQLite file)."""

    def __init__(self, sim: WanSim, workdir: Path, spec: Path) -> None:
        self.sim, self.workdir, self.spec = sim, workdir, spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.db: str | None = None
        self.starts = 0
        self.host = sim.ip("coord")

    def start(self) -> None:
        """Start it and wait until it takes peers."""
        self.starts += 1
        argv = [*SW, "-v", "coordinator", "--spec", str(self.spec), "--state-dir", str(self.workdir / "coordinator")]
        argv += ["--host", self.host, "--grpc-port", "7500", "--dht-port", "7600", "--http-port", "8080"]
        if self.db:
            argv += ["--db", self.db]
        log = self.workdir / f"coordinator.{self.starts}.log"
        self.proc = self.sim.run("coord", argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(log, r"^peers join with:", 90)

    def kill(self) -> None:
        """SIGKILL it and what it started (a lost machine)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop it cleanly (SIGINT), killing it after a minute."""
        proc, self.proc = self.proc, None
        if proc is not None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
