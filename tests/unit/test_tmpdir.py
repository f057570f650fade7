"""A temporary directory too long for torch's shared-memory socket is refused in one line,
and the limit is torch's real one (its manager started under the longest allowed directory,
and failing one byte beyond)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from protocol.errors import ConfigError
from protocol.tmpdir import SOCKET_PATH_MAX, SOCKET_SUFFIX, check_tmpdir, torch_tmpdir

LONGEST = SOCKET_PATH_MAX - SOCKET_SUFFIX


def a_dir_of(length: int) -> str:
    """A path of ``length`` bytes under /tmp, its own (suites may run side by side)."""
    prefix = f"/tmp/swarmtrain-{uuid.uuid4().hex[:8]}-"
    return prefix + "x" * (length - len(prefix))


def test_the_variable_torch_reads_is_checked_and_named() -> None:
    assert torch_tmpdir({}) == ("/tmp", None)
    assert torch_tmpdir({"TMPDIR": "", "TMP": "/scratch"}) == ("/scratch", "TMP")  # empty: unset
    check_tmpdir({"TMPDIR": a_dir_of(LONGEST)})
    with pytest.raises(ConfigError) as refused:
        check_tmpdir({"TEMP": a_dir_of(LONGEST + 1)})
    message = str(refused.value)
    assert message.startswith(f"TEMP is {LONGEST + 1} bytes long") and f"at most {LONGEST} bytes" in message
    assert "\n" not in message


def _share_a_tensor_under(directory: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import torch, torch.multiprocessing as mp\n"
        "mp.set_sharing_strategy('file_system')\n"  # as hivemind sets it
        "torch.zeros(4).share_memory_()\n"
    )
    env = {"TMPDIR": directory, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_limit_is_torchs() -> None:
    """torch_shm_manager starts under a directory of exactly the allowed length, and not under
    one byte more (what the check is for)."""
    made: list[Path] = []
    try:
        for length in (LONGEST, LONGEST + 1):
            directory = Path(a_dir_of(length))
            directory.mkdir(exist_ok=True)
            made.append(directory)
            result = _share_a_tensor_under(str(directory))
            if length == LONGEST:
                assert result.returncode == 0, result.stderr[-2000:]
            else:
                assert result.returncode != 0 and "torch_shm_manager" in result.stderr, result.stderr[-2000:]
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
