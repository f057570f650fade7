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


def new_core(directory: Path, spec_toml: str = CORE_SPEC) -> Coordinator:
    """A coordinator core on a fresh SQLite store under ``directory`` (close its ``store``)."""
    store = Store(sqlite_url(directory))
    return Coordinator(
        spec=parse_spec(spec_toml), spec_toml=spec_toml, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    """A coordinator core on a fresh SQLite store, with a minimal spec."""
    made = new_core(tmp_path)
    yield made
    made.store.close()


@pytest.fixture
def compiled_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compiled kernels (``engine.kernels``) for every codec and host pass, whatever a peer
    built earlier in this process chose (``engine.compression.choose_kernels``)."""
    from engine.compression import KERNELS_ENV, compiled_kernels

    monkeypatch.setenv(KERNELS_ENV, "on")
    compiled_kernels.cache_clear()
    assert compiled_kernels() is not None
    yield
    compiled_kernels.cache_clear()
