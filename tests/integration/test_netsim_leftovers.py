"""A WAN simulator that a killed run left behind (SIGKILL skips its teardown: a CI job's time
limit, a session's end) no longer blocks the next simulator of the same prefix: its subnet is
freed of the dead run's bridge and namespaces, and a live run's are left alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.netsim import WanSim, pid_alive

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2"
)

PREFIX = "stl"
CHILD = f"""
import sys, time
from benchmarks.netsim import WanSim
with WanSim(hosts=["a", "b"], rate="100mbit", prefix={PREFIX!r}) as sim:
    print(sim.names.suffix, flush=True)
    time.sleep(600)
"""


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{PREFIX}-")]


def test_a_killed_runs_simulator_is_removed_when_the_next_one_starts() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        suffix = child.stdout.readline().strip()
        assert suffix, "the child's simulator did not come up"
        dead = [ns for ns in _namespaces() if f"-{child.pid}-{suffix}-" in ns]
        assert len(dead) == 2, dead
        os.kill(child.pid, signal.SIGKILL)  # no teardown
        child.wait(timeout=30)
        deadline = time.monotonic() + 10
        while pid_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(dead) <= set(_namespaces())  # left behind, holding the subnet
        with WanSim(hosts=["a", "b"], rate="100mbit", prefix=PREFIX) as sim:  # the same subnet
            assert sim.ip("a") == "10.77.0.2"
            assert not set(dead) & set(_namespaces())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert not [ns for ns in _namespaces() if f"-{child.pid}-" in ns]
