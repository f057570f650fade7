"""Opening the coordinator database: URL checks, SQLite pragmas, schema creation and version.

``open_engine(url)`` returns a ready engine or raises ``ConfigError`` with one line naming
the database (password hidden) and what was wrong; it never returns a half-open engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, insert, select, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from coordinator.store.schema import SCHEMA_VERSION, Base, SchemaVersion
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)

_SQLITE_PRAGMAS = ("PRAGMA synchronous=FULL", "PRAGMA foreign_keys=ON")


def sqlite_url(state_dir: Path) -> str:
    """The default database: ``sqlite:///<state_dir>/coordinator.db`` (absolute path)."""
    return f"sqlite:///{Path(state_dir).resolve() / 'coordinator.db'}"


def open_engine(url: str) -> Engine:
    """Connect to ``url``, create missing tables and check or record the schema version.

    Raises ``ConfigError`` for a malformed URL, an unknown dialect, a missing driver, a
    SQLite path that cannot be opened, an unreachable server or a foreign schema version.
    """
    parsed = _parse(url)
    shown = parsed.render_as_string(hide_password=True)
    engine = _create(parsed, shown)
    try:
        Base.metadata.create_all(engine)
        _check_version(engine, shown)
    except ConfigError:
        engine.dispose()
        raise
    except SQLAlchemyError as exc:
        engine.dispose()
        raise ConfigError(f"database {shown}: cannot open it ({_first_line(exc)})") from exc
    logger.info("opened database %s (schema version %d)", shown, SCHEMA_VERSION)
    return engine


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"database URL {url!r} is not a SQLAlchemy URL ({exc})") from exc
    if parsed.get_backend_name() == "sqlite" and not _in_memory(parsed):
        path = Path(str(parsed.database))
        if not path.parent.is_dir():
            raise ConfigError(f"database {url}: directory {path.parent} does not exist")
        if path.is_dir():
            raise ConfigError(f"database {url}: {path} is a directory, not a database file")
    return parsed


def _create(parsed: URL, shown: str) -> Engine:
    sqlite = parsed.get_backend_name() == "sqlite"
    kwargs: dict[str, Any] = {"pool_pre_ping": not sqlite}
    if sqlite and _in_memory(parsed):
        # One shared connection: otherwise each pooled connection sees its own empty database.
        kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    try:
        engine = create_engine(parsed, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise ConfigError(f"database {shown}: unsupported dialect or driver not installed ({exc})") from exc
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL + synchronous=FULL: a commit is on disk when it returns, even across power loss."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        mode = cursor.fetchone()[0]
        if mode not in ("wal", "memory"):
            logger.warning("SQLite refused WAL journaling (journal_mode=%s)", mode)
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
    finally:
        cursor.close()


_MIGRATIONS = {
    # version 1 -> 2: create_all added the data_slots table; rounds gains a column
    1: ("ALTER TABLE rounds ADD COLUMN validation_loss FLOAT",),
    # version 2 -> 3: the rounds' states and time split, the swarm's failed rounds
    2: (
        "ALTER TABLE rounds ADD COLUMN states INTEGER",
        *(
            f"ALTER TABLE rounds ADD COLUMN {column} FLOAT"
            for column in ("compute_s", "matchmaking_s", "allreduce_s", "landing_s", "bytes_sent", "bytes_received")
        ),
        "ALTER TABLE swarm_samples ADD COLUMN rounds_failed INTEGER NOT NULL DEFAULT 0",
    ),
}
"""Statements that take a database from version ``key`` to ``key + 1`` (new tables come from
``create_all``), run in one transaction with the new version's record."""


def _check_version(engine: Engine, shown: str) -> None:
    with engine.begin() as conn:
        versions = list(conn.scalars(select(SchemaVersion.version)))
        if not versions:
            conn.execute(insert(SchemaVersion).values(version=SCHEMA_VERSION, applied_at=time.time()))
            return
        version = max(versions)
        while version in _MIGRATIONS and version < SCHEMA_VERSION:
            for statement in _MIGRATIONS[version]:
                conn.execute(text(statement))
            version += 1
            conn.execute(insert(SchemaVersion).values(version=version, applied_at=time.time()))
            logger.info("database %s migrated to schema version %d", shown, version)
        if version != SCHEMA_VERSION:
            raise ConfigError(f"database {shown} has schema version {version}; this swarmtrain needs {SCHEMA_VERSION}")


def _in_memory(parsed: URL) -> bool:
    return parsed.database in (None, "", ":memory:")


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    return str(orig if orig is not None else exc).splitlines()[0]
