"""The suite's ports: outside the kernel's ephemeral range, and never handed to two processes."""

from __future__ import annotations

import random
import subprocess
import sys

from protocol.ports import ephemeral_range
from tests import ports

CLAIM_50 = "import random; random.seed(0); from tests.ports import free_ports; print(*free_ports(50))"
"""Every claimer draws the same random sequence: without the claims they would get the same ports."""


def test_ports_lie_outside_the_ephemeral_range_and_are_distinct() -> None:
    low, high = ephemeral_range()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    assert all(p < low or p > high for p in got)


def test_two_processes_never_get_the_same_port_while_both_live() -> None:
    # both claim while the other is alive: started together, each holds its claims until it exits
    script = CLAIM_50 + "; import sys; sys.stdin.read()"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        got = [set(map(int, p.stdout.readline().split())) for p in procs if p.stdout]
        random.seed(0)
        mine = set(ports.free_ports(50))  # while both still live (a dead process's claims lapse)
    finally:
        for p in procs:
            p.communicate("", timeout=30)
    assert len(got[0]) == len(got[1]) == len(mine) == 50
    assert not got[0] & got[1] and not (got[0] | got[1]) & mine


def test_a_dead_processs_claims_lapse() -> None:
    done = subprocess.run([sys.executable, "-c", CLAIM_50], capture_output=True, text=True, check=True)
    port = int(done.stdout.split()[0])
    assert ports._claim(port)
    assert not ports._claim(port)  # this process's own claim is not handed out twice
