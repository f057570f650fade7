"""`swarmtrain demo` as a user runs it: a coordinator and 3 peers train, the summary shows
verified credits per peer, it exits 0 and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXE = shutil.which("swarmtrain", path=str(Path(sys.executable).parent)) or "swarmtrain"


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_demo_trains_summarises_and_cleans_up(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    workdir = tmp_path / "work"
    proc = subprocess.run(
        [EXE, "demo", "--rounds", "3", "--summary-json", str(summary_path), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo summary" in proc.stdout and "demo succeeded" in proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and summary["digests_agree"] and summary["rounds"] >= 3
    assert summary["loss_last"] < summary["loss_first"]
    assert all(p["credited_samples"] > 0 and p["credited_flops"] > 0 for p in summary["peers"]), summary
    assert "dashboard at http://127.0.0.1:" in proc.stdout
    assert processes_mentioning(str(workdir)) == []
