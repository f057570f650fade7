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
    "test_dht_start.py",
    "test_dial_order.py",
    "test_doctor.py",
    "test_grpc_fuzz.py",
    "test_killed_peer_credit.py",
    "test_model_export.py",
    "test_netsim_leftovers.py",
    "test_record_bounds.py",
    "test_reducer_close.py",
    "test_state_refusal_bytes.py",
    "test_state_sync.py",
    "test_store_crash.py",
}
"""Integration and end-to-end tests that start no swarm of peer processes (a few in-process
averagers or DHT nodes, or one child process at a time; the outage tests' two tiny peers wait
for their coordinator, or average a few rounds without it): mostly waiting, they keep
pytest-timeout's 300 s and, with the unit tests, carry the ``beside_swarms`` mark."""


SWARM_TIMEOUT_S = 600
"""pytest-timeout's limit for a test that starts a swarm (300 s for the others, pyproject.toml).
A swarm scenario is a chain of steps (processes started, rounds landed, a restart answering,
a late joiner in sync) that each wait for their progress with a deadline of their own, and
a step that stops making progress fails there, naming itself. The whole chain's limit is
only a guard against a hang: it is no measure of speed, and a chain that took 90-175 s here
beside the other lane took more than 300 s on a machine 1.5x slower with every step inside
its own deadline (``test_coordinator_crash``)."""

EXPECTED_S = {
    "test_nat.py": 340,
    "test_hostile_peers.py": 260,
    "test_coordinator_crash.py": 210,
    "test_forged_state.py": 180,
    "test_local_ranks.py": 165,
    "test_one_swarm.py": 145,
    "test_slow_joiner.py": 140,
    "test_llama_tiny.py": 135,
    "test_bad_tensors.py": 125,
    "test_archive.py": 120,
    "test_readme.py": 115,
    "test_swarm_training.py": 115,
    "test_coordinator_outage.py": 105,
    "test_authorized_averaging.py": 95,
    "test_fault_tolerance.py": 95,
    "test_reachability_and_leave.py": 80,
    "test_cli.py": 75,
    "test_killed_peer_credit.py": 70,
    "test_coordinator_swarm.py": 60,
    "test_state_sync.py": 45,
    "test_clean_leave.py": 45,
    "test_compiled_blocks.py": 40,
    "test_doctor.py": 40,
    "test_demo.py": 40,
    "test_readme_swarm.py": 35,
    "test_dashboard.py": 35,
    "test_broken_member.py": 30,
}
"""The integration and end-to-end files of 30 s or more, with their seconds in a ``make test``
here (the junit times of two runs, rounded), which orders them (longest first); any other file
counts as ``OTHER_FILE_S``. A wrong figure costs balance, never a result."""
OTHER_FILE_S = 20.0


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test`` runs the suite in two pytest sessions at once. The tests that start swarms
    of peer processes (integration and e2e files not in ``BESIDE_SWARMS``) run under
    pytest-xdist (``-n 2 --dist loadgroup --no-loadscope-reorder -m "not beside_swarms"``):
    each file is one group (one worker runs all of it, so a file's module fixtures, a shared
    swarm, run once), handed out longest first (``EXPECTED_S``) to whichever worker is free, so
    that both finish together. Beside them, one more session runs the rest in order
    (``-m beside_swarms``: the light files, longest first, then the unit tests): the light
    files mostly wait (a 60 s coordinator outage, killed peers' outages, state transfers), and
    the two workers left the CPU 18-40% idle while they ran there, so the two sessions never
    run more than two swarms at once and leave less of it idle. A test that starts a swarm gets
    ``SWARM_TIMEOUT_S``."""
    order: dict[int, tuple[int, float, int]] = {}
    beside = pytest.mark.beside_swarms
    for index, item in enumerate(items):
        parts = item.path.parts
        if "unit" in parts:
            order[id(item)] = (1, 0.0, index)
            item.add_marker(beside)
            continue
        name = item.path.name
        if name in BESIDE_SWARMS:
            item.add_marker(beside)
        elif item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SWARM_TIMEOUT_S))
        order[id(item)] = (0, -EXPECTED_S.get(name, OTHER_FILE_S), index)
        item.add_marker(pytest.mark.xdist_group(str(item.path.relative_to(REPO_ROOT))))
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
