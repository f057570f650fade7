"""``kill -9`` of a process writing the ledger loses no committed grant and leaves a sound
SQLite file: every grant the child printed (after its commit returned) is there on reopen."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest

from coordinator.store import Store, sqlite_url
from tests.integration.program_child import ProgramChild

pytestmark = pytest.mark.integration

SAMPLES = 7
KILL_AFTER = 50
DEADLINE_S = 180.0

CHILD = """
import sys
from coordinator.store import Store

store = Store(sys.argv[1])
n = 0
while True:
    n += 1
    store.record_claim(key="p1", round=n, samples=%(samples)d, group_json="[]", state_digest="d",
                       duration_s=1.0, received_at=float(n))
    store.decide_claim(key="p1", round=n, status="granted", granted_samples=%(samples)d,
                       flops=2.0, reason="ok", now=float(n))
    print(f"granted {n}", flush=True)
""" % {"samples": SAMPLES}  # noqa: UP031 - a program text full of braces


def _last_grant(lines: list[str]) -> int:
    numbers = [int(m.group(1)) for m in (re.fullmatch(r"granted (\d+)\n?", line) for line in lines) if m]
    return max(numbers, default=0)


def test_sigkill_loses_no_committed_grant(tmp_path: Path, repo_root: Path, python: str) -> None:
    url = sqlite_url(tmp_path)
    child = ProgramChild(python, repo_root, CHILD, url)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while _last_grant(child.lines) < KILL_AFTER:
            child.next_line(deadline)
        child.kill9()
    finally:
        child.reap()
    seen = child.lines
    printed = _last_grant(seen)
    assert printed >= KILL_AFTER

    with Store(url) as store:
        credited = store.credits_by_peer()["p1"].samples
        granted_rounds = {c.round for c in store.claims(key="p1", limit=100_000) if c.status == "granted"}
    assert credited >= printed * SAMPLES
    assert set(range(1, printed + 1)) <= granted_rounds
    assert credited == len(granted_rounds) * SAMPLES  # no credit without its granted claim

    db = sqlite3.connect(tmp_path / "coordinator.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        db.close()
