"""State digests, their signed DHT records, and which state a newcomer accepts."""

from __future__ import annotations

import json

import blake3
import pytest
import torch

from protocol.agreement import Vote
from protocol.errors import VerificationError
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.statesync import (
    DIGEST_KIND,
    DIGEST_PREFIX,
    DigestRecord,
    collect_records,
    make_digest_record,
    parse_digest_record,
    record_votes,
    run_prefix,
    state_digest,
)


def fake_digest(tag: str) -> str:
    """A well-formed state digest standing for the state called ``tag``."""
    return DIGEST_PREFIX + blake3.blake3(tag.encode()).hexdigest()


NOW = 1_800_000_000.0


def test_digest_covers_round_and_every_byte() -> None:
    params, momentum = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    base = state_digest(3, params, momentum)
    assert base == state_digest(3, params.clone(), momentum.clone())
    assert base != state_digest(4, params, momentum)
    nudged = params.clone()
    nudged[7] = torch.nextafter(nudged[7], torch.tensor(100.0))
    assert base != state_digest(3, nudged, momentum)
    assert base != state_digest(3, momentum, params)  # order matters
    with pytest.raises(ValueError, match="float32"):
        state_digest(3, params.double(), momentum)


def test_record_round_trip_and_archive_flag() -> None:
    me = Identity.generate()
    record = parse_digest_record(make_digest_record(me, round_=5, digest=fake_digest("ab"), now=NOW), now=NOW)
    assert record == DigestRecord(me.public_key, 5, fake_digest("ab"), archive=False)
    archived = make_digest_record(me, round_=5, digest=fake_digest("ab"), now=NOW, archive=True)
    assert parse_digest_record(archived, now=NOW).archive is True
    landed = make_digest_record(me, round_=5, digest=fake_digest("ab"), now=NOW, landed=NOW - 2.5)
    assert parse_digest_record(landed, now=NOW).landed == NOW - 2.5
    for late in (NOW + 0.0004, NOW + 0.0006):  # a landing time read as the record was signed
        record = parse_digest_record(make_digest_record(me, round_=5, digest=fake_digest("ab"), now=late), now=NOW)
        assert record.landed is None
        stamped = make_digest_record(me, round_=5, digest=fake_digest("ab"), now=late, landed=late)
        assert parse_digest_record(stamped, now=NOW).landed == pytest.approx(late, abs=0.001)


def _signed(body: object, identity: Identity, kind: str = DIGEST_KIND, now: float = NOW) -> bytes:
    return sign_message(identity, kind, json.dumps(body).encode(), now=now).to_bytes()


@pytest.mark.parametrize(
    "body",
    [
        {"round": True, "digest": fake_digest("ab")},
        {"round": -1, "digest": fake_digest("ab")},
        {"round": 1.0, "digest": fake_digest("ab")},
        {"round": 1, "digest": "md5:ab"},
        {"round": 1},
        {"round": 1, "digest": fake_digest("ab"), "archive": "yes"},
        [1, fake_digest("ab")],
        {"round": 1, "digest": fake_digest("ab"), "landed": NOW + 60},
        {"round": 1, "digest": fake_digest("ab"), "landed": -1.0},
        {"round": 1, "digest": fake_digest("ab"), "landed": True},
        {"round": 1, "digest": fake_digest("ab"), "landed": "yesterday"},
        {"round": 1, "digest": fake_digest("ab"), "landed": 1e400},
    ],
    ids=[
        "bool-round",
        "negative-round",
        "float-round",
        "bad-digest",
        "no-digest",
        "string-archive",
        "list",
        "landed-after-its-signature",
        "negative-landed",
        "bool-landed",
        "string-landed",
        "infinite-landed",
    ],
)
def test_malformed_record_bodies_are_refused(body: object) -> None:
    with pytest.raises(VerificationError):
        parse_digest_record(_signed(body, Identity.generate()), now=NOW)


def test_wrong_kind_stale_and_non_bytes_records_are_refused() -> None:
    me = Identity.generate()
    with pytest.raises(VerificationError):
        parse_digest_record(_signed({"round": 1, "digest": fake_digest("ab")}, me, kind="other"), now=NOW)
    with pytest.raises(VerificationError):
        parse_digest_record(make_digest_record(me, round_=1, digest=fake_digest("ab"), now=NOW - 10_000), now=NOW)
    with pytest.raises(VerificationError):
        parse_digest_record("not bytes", now=NOW)


def test_collect_drops_invalid_and_misfiled_records() -> None:
    a, b = Identity.generate(), Identity.generate()
    values = {
        a.public_key.id: make_digest_record(a, round_=2, digest=fake_digest("aa"), now=NOW),
        "ed25519:someone-else": make_digest_record(
            b, round_=9, digest=fake_digest("bb"), now=NOW
        ),  # filed under another id
        b.public_key.id: b"garbage",
    }
    assert [r.signer for r in collect_records(values, now=NOW)] == [a.public_key]


def test_records_vote_by_their_signers_key() -> None:
    keys = [Identity.generate().public_key for _ in range(2)]
    records = [DigestRecord(keys[0], 4, fake_digest("x")), DigestRecord(keys[1], 2, fake_digest("old"), archive=True)]
    assert record_votes(records) == [Vote(keys[0].id, 4, fake_digest("x")), Vote(keys[1].id, 2, fake_digest("old"))]


def test_run_prefix_depends_on_the_spec_digest_only() -> None:
    assert run_prefix("sha256:0123456789abcdef0123") == "st0123456789abcdef"
    assert run_prefix("sha256:0123456789abcdef0123") != run_prefix("sha256:fedcba9876543210")


def test_digest_does_not_depend_on_the_hashing_threads_and_rejects_malformed_forms() -> None:
    from protocol.statesync import is_state_digest

    params, momentum = torch.randn(3_000_000), torch.randn(3_000_000)
    one = state_digest(7, params, momentum, threads=1)
    assert one == state_digest(7, params, momentum, threads=4) and is_state_digest(one)
    for bad in ("sha256:" + "0" * 64, DIGEST_PREFIX + "0" * 63, DIGEST_PREFIX + "G" * 64, DIGEST_PREFIX + "A" * 64, 7):
        assert not is_state_digest(bad)
