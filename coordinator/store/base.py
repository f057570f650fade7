"""``Transactions``: the store's connection to its database and the one way it writes.

Every write is one transaction, committed before the method returns; reads see every earlier
committed write. A write that returned is durable: on SQLite every connection runs with
``journal_mode=WAL``, ``synchronous=FULL`` (fsync at each commit) and ``foreign_keys=ON``
(``coordinator.store.engine``), so a ``kill -9`` or power loss mid-write rolls that write back
whole and loses nothing committed. Writes are serialized by a lock inside the object (one
coordinator process owns the database); reads run concurrently."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

from sqlalchemy.orm import Session, sessionmaker

from coordinator.store.engine import open_engine


class Transactions:
    """The database at a SQLAlchemy URL: ``_write`` (one transaction) and ``_read`` (a session)."""

    def __init__(self, url: str) -> None:
        """Open ``url``, creating missing tables; ``ConfigError`` if it cannot be used."""
        self.engine = open_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()

    def close(self) -> None:
        """Release every connection; committed data is already on disk."""
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._write_lock, self._sessions.begin() as session:
            yield session

    def _read(self) -> Session:
        return self._sessions()
