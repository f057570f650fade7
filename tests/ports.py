"""Ports a test hands to a process it starts, which no other test and no outgoing connection takes.

A port bound to 0 and closed again lies in the kernel's ephemeral range: until the test's
process binds it, any outgoing connection on the machine (gRPC, a DHT, the other pytest
session) may be given it, and a coordinator restarted on its old port after an outage waits
seconds with it free. One CI run lost a coordinator that way ("Address already in use").
These ports come from below (or above) that range, where the kernel never assigns one, and
each is claimed machine-wide by a file naming the claiming process, so two tests (in either
of the suite's concurrent sessions) never get the same one; a dead process's claims lapse.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
from pathlib import Path

from protocol.pids import pid_alive
from protocol.ports import LOWEST, bindable, quiet_ports

CLAIMS = Path(tempfile.gettempdir()) / f"swarmtrain-test-ports-{os.getuid()}"
"""One file per claimed port, holding the claiming process's pid (per user: the suite runs as one)."""
TRIES = 1_000


def _claim(port: int) -> bool:
    """Claim ``port`` for this process; a claim whose process is gone is taken over. Under one
    lock on the claims directory: a claim file is read, judged and written as one step (a file
    created and not yet written read as a dead owner's, and two processes took the same port)."""
    CLAIMS.mkdir(exist_ok=True)
    path = CLAIMS / str(port)
    with open(CLAIMS / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            owner = int(path.read_text())
        except (OSError, ValueError):
            owner = 0
        if owner == os.getpid() or (owner and pid_alive(owner)):
            return False
        path.write_text(str(os.getpid()))
        return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now, outside the ephemeral range, claimed for this process."""
    candidates, ports = quiet_ports() or range(LOWEST, 65_536), []  # all ephemeral: claims only
    for _ in range(TRIES):
        if len(ports) == n:
            return ports
        port = random.choice(candidates)
        if port not in ports and bindable(port, "127.0.0.1") and _claim(port):
            ports.append(port)
    if len(ports) == n:
        return ports
    raise RuntimeError(f"found {len(ports)} of {n} free ports in {candidates} after {TRIES} tries")


def free_port() -> int:
    """One port as :func:`free_ports` gives them."""
    return free_ports(1)[0]
