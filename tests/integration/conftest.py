"""Fixtures of the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy

from coordinator.store import sqlite_url

POSTGRES_URL = os.environ.get("SWARMTRAIN_TEST_POSTGRES_URL", "")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The coordinator's database: SQLite under its state dir, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "state")
    if not POSTGRES_URL:
        pytest.skip("set SWARMTRAIN_TEST_POSTGRES_URL to run against PostgreSQL (make test does)")
    engine = sqlalchemy.create_engine(POSTGRES_URL)
    meta = sqlalchemy.MetaData()
    meta.reflect(engine)
    meta.drop_all(engine)
    engine.dispose()
    return POSTGRES_URL
