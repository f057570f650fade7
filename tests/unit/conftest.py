"""Fixtures shared by unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from coordinator.store import Store, sqlite_url
from protocol.identity import Identity
from protocol.spec import parse_spec

CORE_SPEC = '[run]\nname = "unit"\n'


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    """A coordinator core on a fresh SQLite store, with a minimal spec."""
    store = Store(sqlite_url(tmp_path))
    yield Coordinator(
        spec=parse_spec(CORE_SPEC), spec_toml=CORE_SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    store.close()
