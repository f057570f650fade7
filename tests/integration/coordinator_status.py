"""What ``swarmtrain status --json`` says of a local coordinator, as a user asks it: the tests
that watch a swarm through its coordinator share this one call."""

from __future__ import annotations

import json
import subprocess

from swarmtrain.localswarm import swarmtrain_executable


def status(address: str) -> dict:
    """The coordinator's status at ``address`` (the CLI's JSON); fails the test on an error."""
    proc = subprocess.run(
        [*swarmtrain_executable(), "status", "--coordinator", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
