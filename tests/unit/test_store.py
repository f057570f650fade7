"""The coordinator's Store against a real database: SQLite in tmp_path, and PostgreSQL when
SWARMTRAIN_TEST_POSTGRES_URL names one (each test starts from an empty schema there)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, text, update

from coordinator.store import SCHEMA_VERSION, ClaimStatus, ClaimVerdict, RoundClaim, RoundTiming, Store, sqlite_url
from coordinator.store.claims import GroupMemberView
from coordinator.store.schema import Base, SchemaVersion
from protocol.errors import ConfigError
from tests.conftest import plain, postgres_url

TIMING = ("compute_s", "matchmaking_s", "allreduce_s", "landing_s", "bytes_sent", "bytes_received")
POSTGRES_ENV = "SWARMTRAIN_TEST_POSTGRES_URL"


def _decision(
    key: str, status: str, granted: int, flops: float, reason: str, *, round: int, in_absentia: RoundClaim | None = None
) -> ClaimVerdict:
    return ClaimVerdict(key, round, ClaimStatus(status), granted, reason, flops=flops, in_absentia=in_absentia)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty database of each kind."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path)
        return
    url = postgres_url()
    if not url:
        pytest.skip(f"set {POSTGRES_ENV} to run against PostgreSQL")
    engine = create_engine(url)
    try:
        Base.metadata.drop_all(engine)
    finally:
        engine.dispose()
    yield url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = Store(store_url)
    try:
        yield opened
    finally:
        opened.close()


def _claim(store: Store, key: str, round: int, samples: int = 100, received_at: float = 10.0) -> bool:
    return store.record_claim(
        key=key,
        round=round,
        samples=samples,
        group_json='[["a", 1.0]]',
        state_digest=f"d{round}",
        duration_s=2.5,
        received_at=received_at,
    )


def _grant(store: Store, key: str, round: int, samples: int, flops: float, now: float = 20.0) -> None:
    store.decide_claim(
        key=key,
        round=round,
        status="granted",
        granted_samples=samples,
        flops=flops,
        reason="attested by group",
        now=now,
    )


def _peer(store: Store, key: str, account: str | None, now: float = 1.0, reachable: bool = True) -> None:
    store.upsert_peer(
        key=key,
        account_key=account,
        libp2p_peer_id=f"Qm{key}",
        software_version="0.1",
        hardware_json='{"gpus": 1}',
        reachable=reachable,
        now=now,
    )


def test_sqlite_url_points_into_state_dir(tmp_path: Path) -> None:
    assert sqlite_url(tmp_path) == f"sqlite:///{tmp_path.resolve()}/coordinator.db"


def test_run_is_recorded_and_replaced(store: Store) -> None:
    assert store.run() is None
    store.set_run(spec_digest="aa", spec_toml="[run]\nname='x'\n", name="x")
    store.set_run(spec_digest="bb", spec_toml="[run]\nname='y'\n", name="y")
    assert plain(store.run()) == {"spec_digest": "bb", "spec_toml": "[run]\nname='y'\n", "name": "y"}


def test_allowlist_is_idempotent(store: Store) -> None:
    store.allow("acct1")
    store.allow("acct1")
    store.allow("acct2")
    store.disallow("acct2")
    store.disallow("never-allowed")
    assert store.allowlist() == {"acct1"}


def test_ban_unban_and_reban_replaces_reason(store: Store) -> None:
    store.ban("p1", "digest mismatch", 5.0)
    store.ban("p2", "spam", 6.0)
    store.ban("p1", "implausible throughput", 7.0)
    store.unban("p2")
    store.unban("not-banned")
    assert store.banned() == {"p1": "implausible throughput"}


def test_upsert_peer_keeps_first_seen(store: Store) -> None:
    _peer(store, "p1", "acct", now=1.0, reachable=True)
    _peer(store, "p1", "acct2", now=9.0, reachable=False)
    _peer(store, "p0", None, now=3.0)
    peers = store.peers()
    assert [p.key for p in peers] == ["p0", "p1"]
    assert plain(peers[1]) == {
        "key": "p1",
        "account_key": "acct2",
        "libp2p_peer_id": "Qmp1",
        "software_version": "0.1",
        "hardware_json": '{"gpus": 1}',
        "reachable": False,
        "first_seen": 1.0,
        "last_seen": 9.0,
    }
    assert peers[0].account_key is None and peers[0].reachable is True


def test_duplicate_claim_returns_false_and_keeps_the_first(store: Store) -> None:
    assert _claim(store, "p1", 3, samples=100) is True
    assert _claim(store, "p1", 3, samples=999) is False
    assert _claim(store, "p2", 3) is True
    assert _claim(store, "p1", 4) is True
    [claim] = store.claims(key="p1", round=3)
    assert claim.samples == 100 and claim.status == "pending"
    assert len(store.pending_claims()) == 3


def test_concurrent_duplicate_claims_record_once(store: Store) -> None:
    results: list[bool] = []
    lock = threading.Lock()

    def report() -> None:
        for round in range(20):
            ok = _claim(store, "p1", round)
            with lock:
                results.append(ok)

    threads = [threading.Thread(target=report) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(results) == 20 and len(results) == 80
    assert len(store.claims(key="p1")) == 20


def test_grant_updates_claim_and_appends_credit(store: Store) -> None:
    _claim(store, "p1", 1, samples=100, received_at=10.0)
    _grant(store, "p1", 1, 80, 1.5e12, now=20.0)
    [claim] = store.claims()
    assert plain(claim) == {
        "key": "p1",
        "round": 1,
        "samples": 100,
        "group_json": '[["a", 1.0]]',
        "state_digest": "d1",
        "duration_s": 2.5,
        "received_at": 10.0,
        "status": "granted",
        "granted_samples": 80,
        "flops": 1.5e12,
        "reason": "attested by group",
        "decided_at": 20.0,
    }
    assert store.pending_claims() == []
    assert plain(store.credits_by_peer()) == {"p1": {"samples": 80, "flops": 1.5e12, "rounds": 1}}


def test_denial_grants_nothing(store: Store) -> None:
    _claim(store, "p1", 1)
    store.decide_claim(
        key="p1",
        round=1,
        status="denied",
        granted_samples=0,
        flops=0.0,
        reason="digest disagrees with the group",
        now=30.0,
    )
    [claim] = store.claims()
    assert claim.status == "denied" and claim.reason == "digest disagrees with the group"
    assert store.credits_by_peer() == {} and store.leaderboard() == []


def test_decide_is_idempotent(store: Store) -> None:
    _claim(store, "p1", 1)
    _grant(store, "p1", 1, 100, 2.0)
    _grant(store, "p1", 1, 100, 2.0)
    store.decide_claim(key="p1", round=1, status="denied", granted_samples=0, flops=0.0, reason="late", now=99.0)
    [claim] = store.claims()
    assert claim.status == "granted" and claim.decided_at == 20.0
    assert plain(store.credits_by_peer()) == {"p1": {"samples": 100, "flops": 2.0, "rounds": 1}}


@pytest.mark.parametrize(
    ("status", "samples", "flops", "message"),
    [("maybe", 1, 1.0, "status"), ("granted", -1, 1.0, ">= 0"), ("granted", 1, -1.0, ">= 0")],
)
def test_decide_rejects_bad_input(store: Store, status: str, samples: int, flops: float, message: str) -> None:
    _claim(store, "p1", 1)
    with pytest.raises(ValueError, match=message):
        store.decide_claim(key="p1", round=1, status=status, granted_samples=samples, flops=flops, reason="", now=1.0)
    assert store.claims()[0].status == "pending"


def test_decide_unknown_claim_raises(store: Store) -> None:
    with pytest.raises(ValueError, match="no claim recorded for peer p9 round 4"):
        _grant(store, "p9", 4, 1, 1.0)


def test_claims_newest_first_filtered_and_limited(store: Store) -> None:
    for round in range(5):
        _claim(store, "p1", round)
        _claim(store, "p2", round)
    assert [(c.key, c.round) for c in store.claims(limit=3)] == [("p2", 4), ("p1", 4), ("p2", 3)]
    assert [c.round for c in store.claims(key="p1")] == [4, 3, 2, 1, 0]
    assert {c.key for c in store.claims(round=2)} == {"p1", "p2"}
    assert [(c.key, c.round) for c in store.pending_claims()][:2] == [("p1", 0), ("p2", 0)]


def test_credits_by_peer_and_by_account_join_through_peers(store: Store) -> None:
    _peer(store, "p1", "alice")
    _peer(store, "p2", "alice")
    _peer(store, "p3", None)
    for key, samples, flops in [("p1", 10, 1.0), ("p2", 20, 2.0), ("p3", 5, 9.0), ("ghost", 1, 0.5)]:
        _claim(store, key, 1)
        _grant(store, key, 1, samples, flops)
    _claim(store, "p1", 2)
    _grant(store, "p1", 2, 30, 3.0)
    assert plain(store.credits_by_peer()) == {
        "p1": {"samples": 40, "flops": 4.0, "rounds": 2},
        "p2": {"samples": 20, "flops": 2.0, "rounds": 1},
        "p3": {"samples": 5, "flops": 9.0, "rounds": 1},
        "ghost": {"samples": 1, "flops": 0.5, "rounds": 1},
    }
    # a peer with no account (or no peer row) counts as its own account
    assert {row.pop("account_key"): row for row in plain(store.leaderboard(limit=100))} == {
        "alice": {"samples": 60, "flops": 6.0, "peers": 2},
        "p3": {"samples": 5, "flops": 9.0, "peers": 1},
        "ghost": {"samples": 1, "flops": 0.5, "peers": 1},
    }


def test_leaderboard_by_flops_per_account(store: Store) -> None:
    _peer(store, "p1", "alice")
    _peer(store, "p2", "bob")
    _peer(store, "p3", "alice")
    for round, (key, flops) in enumerate([("p1", 1.0), ("p2", 5.0), ("p3", 3.0), ("p4", 0.5)]):
        _claim(store, key, round)
        _grant(store, key, round, 10, flops)
    board = store.leaderboard()
    assert [(r.account_key, r.flops, r.samples, r.peers) for r in board] == [
        ("bob", 5.0, 10, 1),
        ("alice", 4.0, 20, 2),
        ("p4", 0.5, 10, 1),
    ]
    assert [r.account_key for r in store.leaderboard(limit=1)] == ["bob"]


def test_rounds_highest_first_and_limited(store: Store) -> None:
    for round in (1, 3, 2):
        _claim(store, "p1", round)
        granted = [_decision("p1", "granted", 1, 1.0, "attested", round=round)]
        store.finalize_round(round=round, now=float(round), mean_loss=None, decisions=granted)
    assert [(r.round, r.state_digest) for r in store.rounds()] == [(3, "d3"), (2, "d2"), (1, "d1")]
    assert [r.round for r in store.rounds(limit=1)] == [3]


def test_a_round_without_a_granted_claim_has_no_record(store: Store) -> None:
    """One peer's denied report of round 2**31 - 1 is not the swarm's current round (issue #14)."""
    _claim(store, "p1", 2**31 - 1)
    denied = [_decision("p1", "denied", 0, 0.0, "averaged with nobody", round=2**31 - 1)]
    store.finalize_round(round=2**31 - 1, now=1.0, mean_loss=None, decisions=denied)
    assert store.rounds() == []
    assert store.claims()[0].status == "denied"


def test_finalize_round_decides_and_records_together(store: Store) -> None:
    for key in ("p1", "p2", "p3"):
        _claim(store, key, 7)
    store.finalize_round(
        round=7,
        now=30.0,
        mean_loss=2.0,
        decisions=[
            _decision("p1", "granted", 100, 1.0, "attested", round=7),
            _decision("p2", "denied", 0, 0.0, "not attested", round=7),
        ],
    )
    assert plain(store.rounds()) == [
        {
            "round": 7,
            "state_digest": "d7",
            "finalized_at": 30.0,
            "group_size": 3,
            "mean_loss": 2.0,
            "samples": 100,
            "validation_loss": None,
            "states": 1,
            **dict.fromkeys(TIMING, None),
        },  # fmt: skip
    ]
    # a later decision for the same round adds to the record and keeps the loss
    store.finalize_round(
        round=7,
        now=40.0,
        mean_loss=None,
        decisions=[
            _decision("p3", "granted", 60, 0.6, "attested", round=7),
        ],
    )
    assert store.rounds()[0].samples == 160
    assert store.rounds()[0].mean_loss == 2.0
    assert plain(store.credits_by_peer()) == {
        "p1": {"samples": 100, "flops": 1.0, "rounds": 1},
        "p3": {"samples": 60, "flops": 0.6, "rounds": 1},
    }


def test_finalize_round_with_a_bad_decision_writes_nothing(store: Store) -> None:
    _claim(store, "p1", 3)
    _claim(store, "p2", 3)
    with pytest.raises(ValueError, match="no claim recorded"):
        store.finalize_round(
            round=3,
            now=5.0,
            mean_loss=1.0,
            decisions=[
                _decision("p1", "granted", 10, 1.0, "ok", round=3),
                _decision("ghost", "granted", 10, 1.0, "ok", round=3),
            ],
        )
    assert store.rounds() == []
    assert store.credits_by_peer() == {}
    assert [c.status for c in store.claims(round=3)] == ["pending", "pending"]


def test_samples_since_and_prune(store: Store) -> None:
    for t in range(10):
        store.record_sample(now=float(t), peers_online=t, samples_per_second=t * 1.5)
    assert [s.at for s in store.samples(since=7.0)] == [7.0, 8.0, 9.0]
    assert plain(store.samples(since=9.0)) == [
        {"at": 9.0, "peers_online": 9, "samples_per_second": 13.5, "rounds_failed": 0}
    ]
    assert store.prune_samples(before=5.0) == 5
    assert store.prune_samples(before=5.0) == 0
    assert [s.at for s in store.samples(since=0.0)] == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_reopen_keeps_everything(store_url: str) -> None:
    with Store(store_url) as first:
        first.set_run(spec_digest="dd", spec_toml="t", name="n")
        first.allow("alice")
        first.ban("p9", "bad", 1.0)
        _peer(first, "p1", "alice")
        _claim(first, "p1", 1)
        _grant(first, "p1", 1, 10, 1.0)
        _claim(first, "p1", 2)
        first.finalize_round(round=1, decisions=[], mean_loss=0.5, now=2.0)
        first.record_sample(now=3.0, peers_online=1, samples_per_second=2.0)
        before = _snapshot(first)
    with Store(store_url) as second:
        assert _snapshot(second) == before
        assert second.pending_claims()[0].round == 2
        assert _claim(second, "p1", 1) is False


def _snapshot(store: Store) -> dict[str, object]:
    return {
        "run": store.run(),
        "allow": store.allowlist(),
        "banned": store.banned(),
        "peers": store.peers(),
        "claims": store.claims(),
        "pending": store.pending_claims(),
        "by_peer": store.credits_by_peer(),
        "board": store.leaderboard(),
        "rounds": store.rounds(),
        "samples": store.samples(since=0.0),
    }


def test_schema_version_recorded_and_foreign_version_refused(store_url: str) -> None:
    Store(store_url).close()
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            assert list(conn.execute(text("SELECT version FROM schema_version"))) == [(SCHEMA_VERSION,)]
            conn.execute(update(SchemaVersion).values(version=SCHEMA_VERSION + 1))
    finally:
        engine.dispose()
    with pytest.raises(ConfigError, match=f"schema version {SCHEMA_VERSION + 1}"):
        Store(store_url)


def test_sqlite_connections_are_durable(tmp_path: Path) -> None:
    with Store(sqlite_url(tmp_path)) as store, store.engine.connect() as conn:
        pragmas = {
            name: conn.execute(text(f"PRAGMA {name}")).scalar()
            for name in ("journal_mode", "synchronous", "foreign_keys")
        }
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1}


def test_in_memory_sqlite_is_shared_across_threads() -> None:
    with Store("sqlite://") as store:
        thread = threading.Thread(target=store.allow, args=("alice",))
        thread.start()
        thread.join(timeout=10)
        assert store.allowlist() == {"alice"}


@pytest.mark.parametrize(
    ("make_url", "message"),
    [
        (lambda d: "definitely not a url", "not a SQLAlchemy URL"),
        (lambda d: "nosuchdb://host/x", "unsupported dialect"),
        (lambda d: "postgresql+nosuchdriver://u@127.0.0.1/x", "unsupported dialect"),
        (lambda d: f"sqlite:///{d}/missing/dir/coordinator.db", "does not exist"),
        (lambda d: f"sqlite:///{d}", "is a directory"),
        (lambda d: f"sqlite:///{_garbage(d)}", "cannot open it"),
    ],
    ids=["garbage", "dialect", "driver", "missing-dir", "directory", "not-a-database"],
)
def test_unusable_url_is_a_config_error(tmp_path: Path, make_url, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        Store(make_url(tmp_path))


def _garbage(directory: Path) -> Path:
    path = directory / "coordinator.db"
    path.write_bytes(b"this is not a SQLite database file, just some bytes " * 40)
    return path


def test_credit_of_one_peer_sums_its_grants_and_its_undecided_claims(store: Store) -> None:
    assert plain(store.credit_of("p1")) == {"samples": 0, "flops": 0.0, "pending_samples": 0}
    for round_, samples in ((1, 100), (2, 50), (3, 70)):
        _claim(store, "p1", round_, samples=samples)
    _claim(store, "p2", 1, samples=999)
    _grant(store, "p1", 1, 80, 1.5e12)
    store.decide_claim(key="p1", round=2, status="denied", granted_samples=0, flops=0.0, reason="no", now=30.0)
    assert plain(store.credit_of("p1")) == {"samples": 80, "flops": 1.5e12, "pending_samples": 70}
    assert plain(store.credit_of("p2")) == {"samples": 0, "flops": 0.0, "pending_samples": 999}


def test_denials_by_peer_count_reasons(store: Store) -> None:
    for round_ in (1, 2, 3):
        _claim(store, "p1", round_)
    _claim(store, "p2", 1)
    for key, round_, reason in [
        ("p1", 1, "its contribution was bounded by 3 of 3 attesting members' robust averaging (x)"),
        ("p1", 2, "its contribution was bounded by 2 of 3 attesting members' robust averaging (y)"),
        ("p1", 3, "averaged with nobody"),
        ("p2", 1, "averaged with nobody"),
    ]:
        store.decide_claim(key=key, round=round_, status="denied", granted_samples=0, flops=0.0, reason=reason, now=5.0)
    assert store.denials_by_peer("robust averaging") == {"p1": 2}
    assert store.denials_by_peer("50%_") == {}  # LIKE wildcards in the text are escaped


def _an_older_database(store_url: str, version: int) -> None:
    """A store holding one decided round (and one swarm sample), rewritten to what ``version``
    looked like: version 2 had no rounds' states and time split, no failed rounds in the samples;
    version 1 had neither those nor ``validation_loss`` nor ``data_slots``."""
    with Store(store_url) as store:
        store.set_run(spec_digest="sha256:x", spec_toml="", name="r")
        store.record_claim(
            key="a", round=0, samples=5, group_json="[]", state_digest="sha256:d", duration_s=1.0, received_at=1.0
        )
        store.finalize_round(
            round=0, decisions=[_decision("a", "granted", 5, 1.0, "", round=0)], mean_loss=2.0, now=2.0
        )
        store.record_sample(now=2.0, peers_online=1, samples_per_second=3.0)
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            dropped = ("states", *TIMING) if version == 2 else ("validation_loss", "states", *TIMING)
            if version == 1:
                conn.execute(text("DROP TABLE data_slots"))
            for column in dropped:
                conn.execute(text(f"ALTER TABLE rounds DROP COLUMN {column}"))
            conn.execute(text("ALTER TABLE swarm_samples DROP COLUMN rounds_failed"))
            conn.execute(update(SchemaVersion).values(version=version))
    finally:
        engine.dispose()


def test_a_version_1_database_is_migrated_in_place(store_url: str) -> None:
    _an_older_database(store_url, 1)
    with Store(store_url) as store:
        assert plain(store.rounds()) == [
            {"round": 0, "state_digest": "sha256:d", "finalized_at": 2.0, "group_size": 1, "mean_loss": 2.0,
             "samples": 5, "validation_loss": None, "states": None, **dict.fromkeys(TIMING, None)}
        ]  # fmt: skip
        store.assign_data_slots(peer_key="a", slots=[0, 1], now=3.0)
        assert store.data_slots() == {0: "a", 1: "a"}
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            assert sorted(v for (v,) in conn.execute(text("SELECT version FROM schema_version"))) == [1, 2, 3]
    finally:
        engine.dispose()


def test_a_version_2_database_gains_the_rounds_time_split_and_keeps_its_rows(store_url: str) -> None:
    _an_older_database(store_url, 2)
    with Store(store_url) as store:
        assert [(r.round, r.samples, r.states, r.compute_s) for r in store.rounds()] == [(0, 5, None, None)]
        assert [(p.at, p.rounds_failed) for p in store.samples(since=0.0)] == [(2.0, 0)]
        store.record_claim(
            key="a", round=1, samples=5, group_json="[]", state_digest="sha256:e", duration_s=1.0, received_at=3.0
        )
        timing = RoundTiming(compute_s=4.0, matchmaking_s=0.5, allreduce_s=1.5, landing_s=0.25, bytes_sent=9.0)
        store.finalize_round(
            round=1, decisions=[_decision("a", "granted", 5, 1.0, "", round=1)], mean_loss=2.0, now=4.0, timing=timing
        )
        store.record_sample(now=4.0, peers_online=1, samples_per_second=3.0, rounds_failed=2)
        newest = store.rounds()[0]
        assert (newest.states, newest.compute_s, newest.landing_s, newest.bytes_received) == (1, 4.0, 0.25, None)
        assert store.samples(since=3.0)[0].rounds_failed == 2


def test_a_decision_in_absentia_records_its_claim_and_credit_together(store: Store) -> None:
    """A member credited without a report of its own: its witnesses' claim is recorded with the
    decision in one transaction; a report of its own afterwards is a duplicate."""
    _claim(store, "p1", 9)
    _claim(store, "p2", 9)
    group = (GroupMemberView("gone", 80.0), GroupMemberView("p1", 100.0))
    body = RoundClaim("gone", 9, 80, group, state_digest="d9", duration_s=3.0, received_at=50.0)
    store.finalize_round(
        round=9,
        now=60.0,
        mean_loss=None,
        decisions=[
            _decision("p1", "granted", 100, 1.0, "attested", round=9),
            _decision("gone", "granted", 80, 0.8, "in absentia", round=9, in_absentia=body),
        ],
    )
    (row,) = store.claims(key="gone")
    assert (row.round, row.samples, row.status, row.granted_samples, row.state_digest) == (9, 80, "granted", 80, "d9")
    assert store.credits_by_peer()["gone"].samples == 80
    assert store.rounds()[0].group_size == 3 and store.rounds()[0].samples == 180
    assert _claim(store, "gone", 9) is False  # its own report, late: nothing changes
    assert store.credits_by_peer()["gone"].samples == 80


def test_a_verdict_on_another_round_is_refused_and_nothing_is_written(store: Store) -> None:
    _claim(store, "p1", 3)
    _claim(store, "p1", 4)
    with pytest.raises(ValueError, match="verdict on round 4"):
        store.finalize_round(
            round=3, now=5.0, mean_loss=1.0, decisions=[_decision("p1", "granted", 10, 1.0, "ok", round=4)]
        )
    assert store.rounds() == [] and [c.status for c in store.claims()] == ["pending", "pending"]


@pytest.mark.parametrize("before_statement", [0, 1, 2, 3])
def test_credit_of_never_misses_a_claim_decided_while_it_reads(store: Store, before_statement: int) -> None:
    """A heartbeat reads a peer's credit while the core decides its claim: whatever statement
    boundary of the read the decision's commit falls on, the claim is counted once, as pending
    or as granted (read as two statements, a grant committed between them counted in neither)."""
    _claim(store, "p1", 1, samples=7)
    statements, deciding = 0, False

    def decide_there(*_args: object) -> None:
        nonlocal statements, deciding
        if deciding:  # the decision's own statements
            return
        if statements == before_statement:
            deciding = True
            _grant(store, "p1", 1, 7, 1e9)
            deciding = False
        statements += 1

    event.listen(store.engine, "before_cursor_execute", decide_there)
    try:
        credit = store.credit_of("p1")
    finally:
        event.remove(store.engine, "before_cursor_execute", decide_there)
    assert credit.samples + credit.pending_samples == 7, credit
    if statements <= before_statement:  # the read had no such boundary: decided after it
        _grant(store, "p1", 1, 7, 1e9)
    assert plain(store.credit_of("p1")) == {"samples": 7, "flops": 1e9, "pending_samples": 0}
