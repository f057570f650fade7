"""Shared test fixtures."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKSTOP_AFTER_TIMEOUT_S = 180.0
"""Seconds past a test's own timeout (pytest-timeout: ``timeout`` in pyproject.toml, 300 s,
or the test's ``timeout`` mark) at which it counts as hung. pytest-timeout should have failed
it by then; one still running is stuck where that signal cannot reach it (the main thread
blocked in C, or a cleanup that hangs after the timeout fired): dump every thread's stack and
end the run, rather than leave CI hanging until its own limit with nothing to read."""


_real_stderr: int | None = None

_worker_databases: dict[str, str] = {}


def plain(value: object) -> object:
    """A typed record (a dataclass), or a list or map of them, as plain lists and maps: what
    a test compares with a literal."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def postgres_url() -> str:
    """The PostgreSQL database this test process may use ("" if ``SWARMTRAIN_TEST_POSTGRES_URL``
    names none): under pytest-xdist each worker gets its own database on that server (created
    on first use), so that two workers never create or drop one schema at once."""
    base = os.environ.get("SWARMTRAIN_TEST_POSTGRES_URL", "")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not base or not worker:
        return base
    if base not in _worker_databases:
        import sqlalchemy

        url = sqlalchemy.engine.make_url(base)
        name = f"{url.database}_{worker}"
        admin = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                exists = conn.execute(sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
                if exists.first() is None:
                    conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        _worker_databases[base] = url.set(database=name).render_as_string(hide_password=False)
    return _worker_databases[base]


BESIDE_SWARMS = {
    "test_abandon_search.py",
    "test_averager_signals.py",
    "test_bad_tensors.py",
    "test_broken_member.py",
    "test_checkpoint_crash.py",
    "test_cli.py",
    "test_coordinator_outage.py",
    "test_data_fetch.py",
    "test_data_prepare.py",
    "test_dht_mend.py",
    "test_doctor.py",
    "test_grpc_fuzz.py",
    "test_killed_peer_credit.py",
    "test_model_export.py",
    "test_record_bounds.py",
    "test_reducer_close.py",
    "test_state_sync.py",
    "test_store_crash.py",
}
"""Integration and end-to-end tests that start no swarm of peer processes (a few in-process
averagers or DHT nodes, or one child process at a time; the outage tests' two tiny peers wait
for their coordinator, or average a few rounds without it): mostly waiting, they run beside the
swarm tests."""


SECOND_LANE = {
    "test_authorized_averaging.py",
    "test_coordinator_crash.py",
    "test_fault_tolerance.py",
    "test_forged_state.py",
    "test_hostile_peers.py",
    "test_nat.py",
}
"""Swarm tests that run one at a time in a lane of their own, beside the other swarm tests'
lane (about half of the swarms' time each). Two swarms at once fit this machine's two cores
since a waiting peer no longer spins DHT lookups (``engine.matchmaking.PacedKeyManager``)."""


SWARM_TIMEOUT_S = 600
"""pytest-timeout's limit for a test that starts a swarm (300 s for the others, pyproject.toml).
A swarm scenario is a chain of steps (processes started, rounds landed, a restart answering,
a late joiner in sync) that each wait for their progress with a deadline of their own, and
a step that stops making progress fails there, naming itself. The whole chain's limit is
only a guard against a hang: it is no measure of speed, and a chain that took 90-175 s here
beside the other lane took more than 300 s on a machine 1.5x slower with every step inside
its own deadline (``test_coordinator_crash``)."""

LIGHT_FIRST = ("test_bad_tensors.py", "test_doctor.py", "test_cli.py", "test_broken_member.py", "test_state_sync.py")
"""The longest light files (about 30-120 s each here), handed out before the other light ones:
the longest first makes the two workers' last minutes even."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup --no-loadscope-reorder``),
    the tests that start swarms of processes (integration, e2e) run in two lanes, one test at
    a time in each (``SECOND_LANE``). xdist hands out the groups in the order of the
    collection, so the items are put in that order: the two lanes first (each worker starts
    on one), then the light tests (``BESIDE_SWARMS``, one group per file: a file's module
    fixtures run once; ``LIGHT_FIRST`` first), then the unit tests (one test each). Whichever
    worker is free takes the next one, beside the lane still running and at the end, so that
    both workers finish together."""
    order: dict[int, tuple[int, int, int]] = {}
    for index, item in enumerate(items):
        parts = item.path.parts
        if "unit" in parts:
            order[id(item)] = (4, 0, index)
            continue
        name = item.path.name
        first = LIGHT_FIRST.index(name) if name in LIGHT_FIRST else 0
        if name in BESIDE_SWARMS:
            group, rank = f"light-{item.path.stem}", 2 if name in LIGHT_FIRST else 3
        elif name in SECOND_LANE:
            group, rank = "swarms-b", 0
        else:
            group, rank = "swarms", 1
        if rank < 2 and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SWARM_TIMEOUT_S))
        order[id(item)] = (rank, first, index)
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: order[id(item)])


def pytest_configure(config: pytest.Config) -> None:
    """Keep a descriptor of the real stderr (output capture is off while plugins configure):
    during a test, fd 2 goes to pytest's capture file, which nobody prints if the run ends
    from the backstop."""
    global _real_stderr
    _real_stderr = os.dup(2)
    logging.getLogger("engine").addHandler(ForkedChildStderr())


class ForkedChildStderr(logging.Handler):
    """The engine's warnings from a process forked off a test (hivemind's averager runs in
    one), written to file descriptor 2: pytest's log capture there is a copy of the parent's,
    in memory, that nobody reads, while fd 2 is pytest's capture file, printed with the test's
    failure. Records of the test process itself are left to pytest's own capture."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.parent = os.getpid()
        self.setFormatter(logging.Formatter("%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if os.getpid() == self.parent:
            return
        try:
            os.write(2, (self.format(record) + "\n").encode(errors="replace"))
        except OSError:
            pass


def _timeout_s(item: pytest.Item) -> float:
    """The test's pytest-timeout limit: its ``timeout`` mark, else the ini's."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0])
    return float(item.config.getini("timeout") or 300)


@pytest.fixture(autouse=True)
def _hang_backstop(request: pytest.FixtureRequest) -> Iterator[None]:
    backstop = _timeout_s(request.node) + BACKSTOP_AFTER_TIMEOUT_S
    faulthandler.dump_traceback_later(backstop, exit=True, file=_real_stderr if _real_stderr is not None else 2)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def python() -> str:
    return sys.executable
