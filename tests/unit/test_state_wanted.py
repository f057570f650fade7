"""``engine.state_wanted.Wanted``: what a state download's request says it takes, read from bytes
any peer may send (a size cap first, then exactly its fields, or nothing)."""

from __future__ import annotations

import pytest
from hivemind.utils import MSGPackSerializer

from engine.state_wanted import MAX_WANTED_BYTES, MAX_WANTED_DIGESTS, Wanted

DIGEST = "blake3:" + "ab" * 32


@pytest.mark.parametrize(
    "wanted",
    [Wanted(frozenset({DIGEST})), Wanted(frozenset({DIGEST, "blake3:cd"}), 12), Wanted(None), Wanted(None, 3)],
    ids=["one", "two-and-newer", "any", "any-newer"],
)
def test_a_request_reads_back_as_written(wanted: Wanted) -> None:
    assert Wanted.parse(MSGPackSerializer, wanted.dumps(MSGPackSerializer)) == wanted


def test_takes_the_named_digests_or_a_newer_round_and_nothing_else() -> None:
    wanted = Wanted(frozenset({DIGEST}), newer_than=10)
    assert wanted.takes(3, DIGEST)
    assert wanted.takes(11, "blake3:other")
    assert not wanted.takes(10, "blake3:other")
    assert not wanted.takes("11", "blake3:other")  # a round must be an integer
    assert not wanted.takes(True, "blake3:other")
    assert not wanted.takes(11, None)  # a claim without a digest is never taken
    assert not Wanted(frozenset({DIGEST})).takes(10**9, "blake3:other")
    assert Wanted(None).takes(0, "blake3:anything")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe garbage",
        MSGPackSerializer.dumps([[DIGEST]]),  # one field
        MSGPackSerializer.dumps([[DIGEST], 1, 2]),  # three
        MSGPackSerializer.dumps({"digests": [DIGEST]}),
        MSGPackSerializer.dumps([DIGEST, None]),  # digests as a string, not a list
        MSGPackSerializer.dumps([[DIGEST] * (MAX_WANTED_DIGESTS + 1), None]),
        MSGPackSerializer.dumps([[""], None]),
        MSGPackSerializer.dumps([["x" * 97], None]),
        MSGPackSerializer.dumps([[7], None]),
        MSGPackSerializer.dumps([[DIGEST], -1]),
        MSGPackSerializer.dumps([[DIGEST], 1.5]),
        MSGPackSerializer.dumps([[DIGEST], True]),
        MSGPackSerializer.dumps([None, "round"]),
        MSGPackSerializer.dumps([[DIGEST], None]) + b"\x00" * MAX_WANTED_BYTES,
    ],
)
def test_anything_else_is_no_request(raw: bytes) -> None:
    assert Wanted.parse(MSGPackSerializer, raw) is None
