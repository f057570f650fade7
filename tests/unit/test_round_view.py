"""The per-round view (``coordinator.round_view``): groups, distinct states and peers that
averaged, from round reports; bounded in rounds and keys; malformed stored rows skipped. The
core feeds it reports built by the peer's own ``CoordinatorLink``, shows it in gRPC status and
``/api/v1/status``, and rebuilds it from the store after a restart."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator import round_view
from coordinator.http.app import create_app
from coordinator.round_view import RoundFigures, RoundWindow
from swarmtrain.commands.status import print_rounds
from tests.unit.conftest import new_core
from tests.unit.round_rows import T0, joined, link, row, send_reports


def test_one_group_one_state() -> None:
    view = RoundWindow()
    for reporter in "abc":
        view.add(round=4, reporter=reporter, members=["c", "a", "b"] if reporter == "c" else "abc", state_digest="d")
    assert view.figures() == [RoundFigures(4, groups=1, states=1, peers_averaged=3, reports=3, decided=False)]


def test_two_groups_two_states_and_members_that_did_not_report() -> None:
    view = RoundWindow()
    view.add(round=7, reporter="a", members="ab", state_digest="d1")
    view.add(round=7, reporter="b", members="ab", state_digest="d1")
    view.add(round=7, reporter="c", members="cde", state_digest="d2")  # d and e averaged but never reported
    (figures,) = view.figures()
    assert (figures.groups, figures.states, figures.peers_averaged, figures.reports) == (2, 2, 5, 3)
    assert view.split_rounds() == 1


def test_a_group_of_one_is_a_peer_that_did_not_average() -> None:
    view = RoundWindow()
    view.add(round=2, reporter="a", members=["a"], state_digest="lonely")
    view.add(round=2, reporter="b", members=[], state_digest="empty")  # names nobody: itself alone
    view.add(round=2, reporter="c", members="cd", state_digest="d")
    (figures,) = view.figures()
    assert (figures.groups, figures.states, figures.peers_averaged, figures.reports) == (1, 1, 2, 3)


def test_the_reporter_is_in_its_group_and_an_empty_digest_is_no_state() -> None:
    view = RoundWindow()
    view.add(round=1, reporter="a", members="b", state_digest="d")  # a group {a, b}
    view.add(round=1, reporter="c", members="cd", state_digest="")  # a group without a digest
    (figures,) = view.figures()
    assert (figures.groups, figures.states, figures.peers_averaged) == (2, 1, 4)


def test_only_the_window_of_highest_rounds_is_kept() -> None:
    view = RoundWindow(window=3)
    for r in range(10):
        view.add(round=r, reporter="a", members="ab", state_digest=f"d{r}")
    assert [f.round for f in view.figures()] == [9, 8, 7]
    view.add(round=2, reporter="b", members="ab", state_digest="late")  # below the window: dropped
    view.add(round=8, reporter="b", members="ab", state_digest="d8")
    assert [(f.round, f.reports) for f in view.figures()] == [(9, 1), (8, 2), (7, 1)]
    view.add(round=12, reporter="a", members="ab", state_digest="x")
    assert [f.round for f in view.figures()] == [12, 9, 8]


def test_keys_per_round_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(round_view, "MAX_KEYS", 5)
    view = RoundWindow()
    for i in range(4):  # each names 3 new keys: 12 keys, 4 groups, 4 states
        view.add(round=1, reporter=f"r{i}", members=[f"m{i}a", f"m{i}b"], state_digest=f"d{i}")
    (figures,) = view.figures()
    assert (figures.groups, figures.states, figures.peers_averaged, figures.reports) == (4, 4, 5, 4)


def test_decided_rounds_and_the_latest_one() -> None:
    view = RoundWindow()
    assert view.latest_decided() is None and view.figures() == [] and view.split_rounds() == 0
    view.add(round=1, reporter="a", members="ab", state_digest="d")
    view.add(round=2, reporter="a", members="ab", state_digest="d")
    view.decided(1)
    view.decided(99)  # not in the window: nothing
    latest = view.latest_decided()
    assert latest is not None and latest.round == 1 and latest.decided
    assert [f.decided for f in view.figures()] == [False, True]


def test_malformed_stored_rows_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    good = {"key": "a", "round": 3, "group_json": json.dumps([["a", 8.0], ["b", 8.0, "x100"]]), "state_digest": "d"}
    rows = [
        good,
        {**good, "key": "b", "status": "granted"},
        {**good, "group_json": "not json"},
        {**good, "group_json": json.dumps({"a": 1})},
        {**good, "group_json": None},
        {**good, "group_json": "[" * 100_000},
        {**good, "round": "3"},
        {"key": "a", "round": 3},
        {**good, "key": "c", "group_json": json.dumps([["c", 1.0], 7, [], [None, 2], ["", 1], ["e"]])},
        {**good, "key": "f", "state_digest": None, "group_json": json.dumps([["f", 1.0], ["g", 1.0]])},
        {**good, "key": "h", "state_digest": "\x00" * 600 + "weird", "group_json": json.dumps([["h", 1], ["i", 1]])},
    ]
    view = RoundWindow()
    with caplog.at_level(logging.WARNING, logger="coordinator.round_view"):
        view.load(rows)
    (figures,) = view.figures()
    # groups {a,b}, {c,e}, {f,g} (no digest), {h,i}; states d and the weird one
    assert (figures.groups, figures.states, figures.peers_averaged, figures.reports) == (4, 2, 8, 5)
    assert figures.decided  # b's claim was decided
    assert "skipped 6 malformed" in caplog.text


def test_the_core_shows_reports_from_peer_links_and_rebuilds_after_a_restart(tmp_path: Path) -> None:
    """Peers' own links turn their trainers' rows into reports: round 1 one group of three, round
    2 split into {a, b} and {c, d} (d never reports), a failed round sends nothing."""
    core = new_core(tmp_path)
    a, b, c, d = (joined(core) for _ in range(4))
    links = {peer: link() for peer in (a, b, c, d)}
    for peer in (a, b, c):
        links[peer].report(row(1, averaged=True, digest="s1", members=[a, b, c]))
    links[a].report(row(2, averaged=True, digest="s2", members=[a, b]))
    links[b].report(row(2, averaged=True, digest="s2", members=[a, b]))
    links[c].report(row(2, averaged=True, digest="s2-other", members=[c, d]))
    links[d].report(row(2, averaged=False, digest="s1"))  # its round failed: no report
    for peer, peer_link in links.items():
        send_reports(core, peer, peer_link, T0 + 130)
    core.tick(now=T0 + 200)

    expected = [
        {"round": 2, "groups": 2, "states": 2, "peers_averaged": 4, "reports": 3, "decided": True},
        {"round": 1, "groups": 1, "states": 1, "peers_averaged": 3, "reports": 3, "decided": True},
    ]
    status = core.status(now=T0 + 201)
    assert [vars_of(v) for v in status.rounds] == expected
    answer = TestClient(create_app(core, threading.Lock(), clock=lambda: T0 + 201)).get("/api/v1/status")
    assert answer.status_code == 200 and answer.json()["rounds"] == expected

    links[a].report(row(3, averaged=True, digest="s3", members=[a, b]))  # pending at the restart
    send_reports(core, a, links[a], T0 + 210)
    core.store.close()
    restarted = new_core(tmp_path)  # same database
    try:
        assert [vars_of(f) for f in restarted.round_view.figures()] == [
            {"round": 3, "groups": 1, "states": 1, "peers_averaged": 2, "reports": 1, "decided": False},
            *expected,
        ]
    finally:
        restarted.store.close()


def vars_of(figures: object) -> dict[str, object]:
    """The six figures of a ``RoundFigures`` or a ``RoundView`` message."""
    return {f: getattr(figures, f) for f in ("round", "groups", "states", "peers_averaged", "reports", "decided")}


def test_the_status_table_marks_a_split_round(capsys: pytest.CaptureFixture[str]) -> None:
    from protocol import coordinator_pb2 as pb

    print_rounds(
        [
            pb.RoundView(round=9, groups=1, states=1, peers_averaged=3, reports=1, decided=False),
            pb.RoundView(round=8, groups=2, states=2, peers_averaged=5, reports=5, decided=True),
            pb.RoundView(round=7, groups=1, states=1, peers_averaged=5, reports=5, decided=True),
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["round", "groups", "states", "averaged", "reports"]
    assert lines[1].split() == ["9", "1", "1", "3", "1", "(reports", "coming)"]
    assert lines[2].split() == ["8", "2", "2", "5", "5", "SPLIT"]
    assert lines[3].split() == ["7", "1", "1", "5", "5"]
