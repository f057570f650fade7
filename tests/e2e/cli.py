"""The ``swarmtrain`` command as the e2e tests run it (``sw``) and the check that it failed without
a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXE = shutil.which("swarmtrain", path=str(Path(sys.executable).parent)) or "swarmtrain"


def sw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **(env or {})}
    )


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
