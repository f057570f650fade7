"""The one rule for which state is the swarm's (protocol.agreement), as every caller uses it."""

from __future__ import annotations

import ast
from pathlib import Path

from protocol.agreement import Agreement, Vote, agreed_state, agreed_states, majority

ROOT = Path(__file__).resolve().parents[2]


def votes(*entries: tuple[str, int, str]) -> list[Vote]:
    return [Vote(*entry) for entry in entries]


def test_a_strict_majority_wins() -> None:
    assert majority(["a", "a", "b"]) == "a"
    assert majority(["a"]) == "a"
    assert majority(["a", "b"]) is None  # a tie is no agreement
    assert majority(["a", "a", "b", "b"]) is None
    assert majority(["a", "b", "c"]) is None  # a plurality is not a majority
    assert majority([]) is None


def test_the_newest_round_decides_and_older_rounds_never_outvote_it() -> None:
    cast = votes(("p1", 5, "new"), ("p2", 4, "old"), ("p3", 4, "old"))
    assert agreed_state(cast) == Agreement(5, "new", 1, 1)
    assert agreed_states(cast) == [Agreement(5, "new", 1, 1), Agreement(4, "old", 2, 2)]


def test_a_tie_at_the_newest_round_is_no_agreement_but_older_rounds_stay_fallbacks() -> None:
    cast = votes(("p1", 5, "x"), ("p2", 5, "y"), ("p3", 4, "old"))
    assert agreed_state(cast) is None
    assert agreed_states(cast) == [Agreement(4, "old", 1, 1)]


def test_two_member_groups() -> None:
    # one behind: the newer state is the group's
    assert agreed_state(votes(("a", 3, "x"), ("b", 4, "y"))) == Agreement(4, "y", 1, 1)
    # same round, two digests: nobody can tell
    assert agreed_state(votes(("a", 4, "x"), ("b", 4, "y"))) is None
    assert agreed_state(votes(("a", 4, "x"), ("b", 4, "x"))) == Agreement(4, "x", 2, 2)


def test_only_eligible_voters_count() -> None:
    members = {"m1", "m2"}
    # three minted keys vote for a forged newer state; two members for the real one
    cast = votes(("m1", 7, "real"), ("m2", 7, "real"), *[(f"sybil{i}", 9, "forged") for i in range(3)])
    assert agreed_state(cast) == Agreement(9, "forged", 3, 3)  # counting every signer is the bug
    assert agreed_state(cast, eligible=members.__contains__) == Agreement(7, "real", 2, 2)
    assert agreed_state(cast, eligible=lambda key: False) is None


def test_each_voter_has_one_vote_its_newest() -> None:
    cast = votes(("p1", 3, "a"), ("p1", 4, "b"), ("p1", 4, "c"), ("p2", 4, "c"))
    assert agreed_state(cast) == Agreement(4, "c", 2, 2)


def test_every_caller_uses_this_rule_and_nobody_counts_votes_by_hand() -> None:
    """The six places that decide which digest is the swarm's call protocol.agreement, and no
    product module counts digests with a Counter or max(..., key=count) of its own."""
    callers = {
        "protocol/statesync.py": "Vote",
        "peer/swarm/swarm.py": "agreed_state",
        "engine/allreduce.py": "agreed_state",
        "coordinator/credits.py": "agreed_state",
        "coordinator/store/store.py": "agreed_state",
        "coordinator/archiver.py": "agreed_state",
    }
    for path, name in callers.items():
        tree = ast.parse((ROOT / path).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "protocol.agreement"
            for alias in node.names
        }
        assert name in imported, f"{path} does not use protocol.agreement.{name}"
    for package in ("protocol", "engine", "relay", "peer", "coordinator"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "agreement.py" or path.name.endswith("_pb2.py"):
                continue
            source = path.read_text()
            assert "Counter(" not in source or "digest" not in source, f"{path}: counts digests by hand"
            assert ".count)" not in source, f"{path}: picks a most common value by hand"
