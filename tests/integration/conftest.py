"""Fixtures of the integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sqlalchemy

from coordinator.store import sqlite_url
from tests.conftest import postgres_url


@pytest.fixture(autouse=True)
def _fresh_mpfuture_backend() -> None:
    """Each test's in-process swarms get fresh cross-process locks and result pipe.

    hivemind's ``MPFuture`` routes every result from every child process forked by this one
    through one pipe guarded by one ``mp.Lock``, both made once per process. A child that an
    earlier test's shutdown had to kill while it held the lock or was half-way through a message
    would leave them locked or garbled, and every later test's averagers and DHTs would wait for
    results that never come. No test here shares a swarm with another one."""
    if "hivemind" in sys.modules:
        from hivemind.utils.mpfuture import MPFuture

        MPFuture.reset_backend()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The coordinator's database: SQLite under its state dir, or a fresh PostgreSQL schema
    (for what depends on the backend: a crash's durability)."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "state")
    url = postgres_url()
    if not url:
        pytest.skip("set SWARMTRAIN_TEST_POSTGRES_URL to run against PostgreSQL (make test does)")
    return _fresh_schema(url)


@pytest.fixture
def server_db_url(tmp_path: Path) -> str:
    """The database a public run's coordinator uses: a fresh PostgreSQL schema where one runs
    here, else SQLite. A swarm scenario whose outcome does not depend on the backend runs once;
    the store's contract runs against both (``tests/unit/test_store.py``), and most other swarm
    tests, like ``make demo``, run on SQLite."""
    url = postgres_url()
    return _fresh_schema(url) if url else sqlite_url(tmp_path / "state")


def _fresh_schema(url: str) -> str:
    engine = sqlalchemy.create_engine(url)
    meta = sqlalchemy.MetaData()
    meta.reflect(engine)
    meta.drop_all(engine)
    engine.dispose()
    return url
