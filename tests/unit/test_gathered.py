"""A member's statement at the start of a round (``protocol.gathered``): another member's bytes,
read field by field."""

from __future__ import annotations

import math

import pytest

from protocol.agreement import Vote
from protocol.gathered import MAX_ROSTER, Gathered, votes

D = "blake3:" + "d" * 64


def test_gathered_votes_need_a_round_and_a_digest() -> None:
    gathered = [
        ("a", {"round": 2, "digest": "x"}),
        ("b", {"digest": "x"}),
        ("c", {"round": True, "digest": "x"}),
        ("d", {"round": -1, "digest": "x"}),
        ("e", "garbage"),
        ("f", {"round": 2, "digest": 5}),
    ]
    assert votes((member, Gathered.parse(data)) for member, data in gathered) == [Vote("a", 2, "x")]


def test_a_statement_survives_its_wire_form() -> None:
    stated = Gathered(id="ed25519:abc", round=7, digest=D, samples=96, roster=5, known=True, meet=9)
    assert Gathered.parse(stated.to_wire()) == stated
    plain = Gathered(id="ed25519:abc", round=7, digest=D, samples=96)
    assert "meet" not in plain.to_wire() and Gathered.parse(plain.to_wire()) == plain


@pytest.mark.parametrize(
    ("field", "value", "read"),
    [
        ("id", 5, ""),
        ("id", "x" * 500, ""),
        ("round", 2**62, None),
        ("round", 1.0, None),
        ("digest", b"bytes", None),
        ("roster", -1, 0),
        ("roster", MAX_ROSTER + 1, 0),
        ("roster", True, 0),
        ("known", 1, False),
        ("meet", -3, None),
    ],
)
def test_a_malformed_field_is_read_as_none_and_the_rest_is_kept(field: str, value: object, read: object) -> None:
    wire = Gathered(id="ed25519:abc", round=7, digest=D, samples=96, roster=5, known=True, meet=9).to_wire()
    parsed = Gathered.parse({**wire, field: value})
    assert parsed is not None and getattr(parsed, field) == read
    kept = {name: v for name, v in vars(parsed).items() if name != field}
    assert kept == {name: v for name, v in vars(Gathered.parse(wire)).items() if name != field}


@pytest.mark.parametrize("samples", ["many", None, True, [1]])
def test_samples_that_are_no_number_claim_nothing_readable(samples: object) -> None:
    parsed = Gathered.parse({"round": 1, "digest": D, "samples": samples})
    assert parsed is not None and math.isnan(parsed.samples)


@pytest.mark.parametrize("data", [None, "text", [1, 2], 5])
def test_what_is_no_map_is_no_statement(data: object) -> None:
    assert Gathered.parse(data) is None
