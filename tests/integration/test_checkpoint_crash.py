"""``kill -9`` of a process writing checkpoints, over and over (issue #14's crash loop): after each
kill the newest checkpoint that the writer finished (``save`` returned) loads and verifies, a
restarted writer resumes from it, and the half-written file the kill left is cleaned up.

The writer is the real ``engine.checkpoint.Checkpointer`` in a child process. Kills land at
three kinds of moment: in the middle of writing the file (the child's file object stops after
its first megabyte), after the file is written but before it is renamed into place (in
``fsync``), and at a seeded random time while it saves in a loop."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

from engine.checkpoint import Checkpointer
from tests.integration.program_child import ProgramChild

KILLS = 9
MODES = ("mid-write", "before-rename", "random")
DEADLINE_S = 60.0
SPEC_DIGEST = "sha256:crashloop"

CHILD = """
import os, pathlib, sys, time
import torch
from engine.checkpoint import Checkpointer

directory, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
checkpointer = Checkpointer(directory, spec_digest=%(digest)r, keep=2)
latest = checkpointer.latest()
first = latest["round"] + 1 if latest else 0
print(f"resumed {first - 1}", flush=True)

def block(where):
    print(f"blocked {where}", flush=True)
    time.sleep(3600)

class StopsMidWrite:
    def __init__(self, raw):
        self.raw, self.written = raw, 0
    def write(self, data):
        if self.written > 2**20:
            block("mid-write")
        self.written += len(data)
        return self.raw.write(data)
    def __getattr__(self, name):
        return getattr(self.raw, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.raw.close()

for round_ in range(first, first + 1000):
    if round_ == first + 2 and mode == "mid-write":
        real_open = pathlib.Path.open
        pathlib.Path.open = lambda self, *a, **k: StopsMidWrite(real_open(self, *a, **k))
    if round_ == first + 2 and mode == "before-rename":
        os.fsync = lambda fd: block("before-rename")
    torch.manual_seed(round_)
    state = {"round": round_, "params": torch.randn(2**20), "momentum": torch.randn(2**20)}
    checkpointer.save(state)
    print(f"saved {round_}", flush=True)
""" % {"digest": SPEC_DIGEST}  # noqa: UP031 - a program text full of braces


def _run_and_kill(python: str, repo_root: Path, directory: Path, mode: str, rng: random.Random) -> tuple[int, int]:
    """One writer's life: (the round it resumed after, the last round it said it saved)."""
    child = ProgramChild(python, repo_root, CHILD, str(directory), mode)
    kill_after_saves = rng.randint(1, 4)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            line = child.next_line(deadline)
            if line.startswith("blocked"):
                break
            if mode == "random" and sum(x.startswith("saved") for x in child.lines) >= kill_after_saves:
                time.sleep(rng.uniform(0.0, 0.3))  # the kill's moment: somewhere in the next save
                break
        child.kill9()
    finally:
        child.reap()
    seen = child.lines
    text = "".join(seen)
    resumed = int(re.search(r"resumed (-?\d+)", text).group(1))  # type: ignore[union-attr]
    saved = [int(n) for n in re.findall(r"saved (\d+)", text)]
    return resumed, max(saved, default=resumed)


def test_kill_9_during_checkpoint_writes_loses_no_finished_checkpoint(
    tmp_path: Path, repo_root: Path, python: str
) -> None:
    rng = random.Random(14)
    directory = tmp_path / "checkpoints"
    last_saved = -1
    torn_seen = 0
    for kill in range(KILLS):
        mode = MODES[kill % len(MODES)]
        resumed, saved = _run_and_kill(python, repo_root, directory, mode, rng)
        assert resumed == last_saved, f"kill {kill}: resumed after round {resumed}, {last_saved} was saved"
        assert saved >= resumed
        torn = list(directory.glob(".*.tmp"))
        if mode != "random":
            assert torn, f"kill {kill} ({mode}) left no half-written file: it did not land mid-write"
        torn_seen += len(torn)
        checkpointer = Checkpointer(directory, spec_digest=SPEC_DIGEST, keep=2)
        assert not list(directory.glob(".*.tmp")), "a torn file outlived the next writer's start"
        latest = checkpointer.latest()
        assert latest is not None
        # the newest finished save (or, killed between the rename and its print, the one after)
        assert latest["round"] in (saved, saved + 1), (kill, mode, latest["round"], saved)
        assert len(list(directory.glob("round-*.pt"))) <= 3  # keep=2, plus one renamed before its prune
        last_saved = latest["round"]
    assert torn_seen >= 2 * KILLS // 3
