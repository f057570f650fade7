"""The commands check their arguments before torch or hivemind loads (a bad flag answers in a
moment, and a peer's signal handlers are in place before the heavy imports): importing the CLI
modules loads neither."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["swarmtrain.cli", "peer.cli", "coordinator.cli"])
def test_importing_a_cli_loads_neither_torch_nor_hivemind(module: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"{module} loads {loaded.strip()} at import"
