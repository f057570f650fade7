"""Receipts (``protocol.receipts``): a member's reducer vouches for a sender's parts; the
coordinator credits a pair's survivor on the word of a member killed during the all-reduce, and
nobody can make a receipt say what its signer did not sign, or carry it to another run, round
or sender. Every attack here goes through the coordinator's own report path."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import MalformedMessageError
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.receipts import MAX_RECEIPT_BYTES, REPORTED_RECEIPTS, ReceiptError, read_receipt, reported, sign_receipt
from protocol.statesync import run_prefix
from tests.unit.claim_calls import join, report
from tests.unit.conftest import new_core

SPEC = '[run]\nname = "receipts"\n[credits]\nmax_samples_per_second = 100.0\n'
T0 = 1_800_000_000.0
ROUND = 7
SAMPLES = 40


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    made = new_core(tmp_path, SPEC)
    yield made
    made.store.close()


def _receipt(
    signer: Identity, sender: Identity, *, run: str, round_: int = ROUND, weight: float = SAMPLES, offence: str = ""
) -> bytes:
    return sign_receipt(
        signer, run=run, round_=round_, sender=sender.public_key, weight=weight, offence=offence, now=T0
    )


def _pair_report(
    core: Coordinator, survivor: Identity, dead: Identity, receipt: bytes, *, round_: int = ROUND, now: float = T0 + 10
) -> pb.RoundReportResponse:
    """``survivor``'s report of a round it averaged with ``dead``, carrying ``receipt`` as dead's."""
    group = [
        pb.GroupMember(public_key=survivor.public_key.raw, weight=SAMPLES),
        pb.GroupMember(public_key=dead.public_key.raw, weight=SAMPLES, receipt=receipt),
    ]
    return report(core, survivor, now, round=round_, samples=SAMPLES, compute_s=9.0, state_digest="d", group=group)


def _credited(core: Coordinator, peer: Identity) -> int:
    credit = core.store.credits_by_peer().get(peer.public_key.id)
    return credit.samples if credit is not None else 0


def _reason(core: Coordinator, peer: Identity, round_: int = ROUND) -> str:
    (claim,) = core.store.claims(key=peer.public_key.id, round=round_)
    return claim.reason


# --- the receipt itself ----------------------------------------------------------------------


def test_a_receipt_reads_back_as_signed_and_nothing_else_does() -> None:
    reducer, sender, other = Identity.generate(), Identity.generate(), Identity.generate()
    run = run_prefix("sha256:" + "ab" * 32)
    good = _receipt(reducer, sender, run=run, weight=12.5, offence="weight capped")
    read = read_receipt(good, reducer=reducer.public_key.id, run=run, round_=ROUND, sender=sender.public_key.id)
    assert (read.weight, read.offence, read.round) == (12.5, "weight capped", ROUND)
    wrong = {
        "another run": dict(run="st" + "0" * 16),
        "another round": dict(round_=ROUND + 1),
        "another sender": dict(sender=other.public_key.id),
        "another reducer": dict(reducer=other.public_key.id),
    }
    for change in wrong.values():
        args = dict(reducer=reducer.public_key.id, run=run, round_=ROUND, sender=sender.public_key.id) | change
        with pytest.raises(ReceiptError):
            read_receipt(good, **args)  # type: ignore[arg-type]
    expect = dict(reducer=reducer.public_key.id, run=run, round_=ROUND, sender=sender.public_key.id)
    body = pb.ReceiptBody(run=run, round=ROUND, sender=sender.public_key.raw, weight=SAMPLES)
    forged = sign_message(other, kinds.RECEIPT, body.SerializeToString(), now=T0)
    tampered = bytearray(good)
    tampered[-70] ^= 1  # inside the signature or the body: either way it no longer verifies
    for bad in (
        b"",
        b"\x00garbage",
        bytes(MAX_RECEIPT_BYTES + 1),
        bytes(tampered),
        forged.to_bytes(),  # a sender signing "the reducer's" receipt itself
        sign_message(reducer, kinds.ROUND_REPORT, body.SerializeToString(), now=T0).to_bytes(),  # another kind
        sign_message(reducer, kinds.RECEIPT, b"\xff\xff", now=T0).to_bytes(),  # no ReceiptBody
        _receipt(reducer, sender, run=run, weight=math.nan),
        _receipt(reducer, sender, run=run, weight=-1.0),
        _receipt(reducer, sender, run=run, weight=2.0**41),
        _receipt(reducer, sender, run=run, offence="a\x00b"),
    ):
        with pytest.raises(ReceiptError):
            read_receipt(bad, **expect)  # type: ignore[arg-type]


# --- the coordinator -------------------------------------------------------------------------


def test_a_pairs_survivor_is_credited_on_its_dead_partners_receipt(core: Coordinator) -> None:
    """The soak's lost round: a pair whose other member was SIGKILLed during the all-reduce,
    after its reducer served the survivor. Without the receipt the survivor's claim has no
    witness; with it, the survivor is credited the weight the dead member's reducer took."""
    survivor, dead, alone, gone = (join(core, T0) for _ in range(4))
    run = run_prefix(core.digest)
    assert (
        _pair_report(core, survivor, dead, _receipt(dead, survivor, run=run, weight=30)).status
        == pb.CLAIM_STATUS_PENDING
    )
    assert _pair_report(core, alone, gone, b"").status == pb.CLAIM_STATUS_PENDING
    core.tick(now=T0 + 40)
    assert _credited(core, survivor) == 0  # a round with a member unreported waits its 60 s
    core.tick(now=T0 + 71)
    assert _credited(core, survivor) == 30  # min(claimed 40, the receipt's 30, the cap)
    assert "receipt of a member whose report never came" in _reason(core, survivor)
    assert _credited(core, alone) == 0 and "no group member of another account attests it" in _reason(core, alone)
    assert _credited(core, dead) == 0  # one witness credits nobody in absentia


def test_a_receipt_nobody_signed_for_this_claim_attests_nothing(core: Coordinator) -> None:
    """A reporter alone in its round carries receipts it made up or collected elsewhere: each is
    dropped (never the report), and the claim has no witness."""
    run = run_prefix(core.digest)
    partner, third = join(core, T0), join(core, T0)
    cases = {
        "self-signed in the partner's name": lambda me: _receipt(me, me, run=run),
        "the partner's, for another round": lambda me: _receipt(partner, me, run=run, round_=ROUND - 1),
        "the partner's, for another run": lambda me: _receipt(partner, me, run="st" + "1" * 16),
        "the partner's, for another sender": lambda me: _receipt(partner, third, run=run),
    }
    liars = {}
    for what, make in cases.items():
        liar = join(core, T0)
        response = _pair_report(core, liar, partner, make(liar), round_=ROUND + len(liars))
        assert response.status == pb.CLAIM_STATUS_PENDING, what
        liars[what] = (liar, ROUND + len(liars))
    # a key the run never admitted signs a receipt for the liar: a name is no admission
    minted, liar = Identity.generate(), join(core, T0)
    _pair_report(core, liar, minted, _receipt(minted, liar, run=run), round_=ROUND + 10)
    liars["a minted key's"] = (liar, ROUND + 10)
    core.tick(now=T0 + 71)
    for what, (liar, round_) in liars.items():
        assert _credited(core, liar) == 0, what
        assert "no group member of another account attests it" in _reason(core, liar, round_), what


def test_a_receipt_that_names_an_offence_denies_and_a_partner_who_reported_decides(core: Coordinator) -> None:
    run = run_prefix(core.digest)
    bounded, reducer = join(core, T0), join(core, T0)
    _pair_report(core, bounded, reducer, _receipt(reducer, bounded, run=run, offence="norm 40x the median"))
    # the partner reported after all, with another digest: its report is the witness, not its receipt
    a, b = join(core, T0), join(core, T0)
    _pair_report(core, a, b, _receipt(b, a, run=run), round_=ROUND + 1)
    group = [pb.GroupMember(public_key=m.public_key.raw, weight=SAMPLES) for m in (a, b)]
    report(core, b, T0 + 11, round=ROUND + 1, samples=SAMPLES, compute_s=9.0, state_digest="other", group=group)
    core.tick(now=T0 + 71)
    assert _credited(core, bounded) == 0 and "robust averaging" in _reason(core, bounded)
    assert _credited(core, a) == 0 and "no majority digest" in _reason(core, a, ROUND + 1)


def test_a_receipt_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """The claim is pending when the coordinator dies; the restarted one decides it from the
    store, receipt included."""
    first = new_core(tmp_path, SPEC)
    survivor, dead = join(first, T0), join(first, T0)
    _pair_report(first, survivor, dead, _receipt(dead, survivor, run=run_prefix(first.digest), weight=25))
    first.store.close()
    second = new_core(tmp_path, SPEC)
    try:
        second.tick(now=T0 + 200)
        assert _credited(second, survivor) == 25
    finally:
        second.store.close()


def test_a_report_carries_at_most_a_few_receipts_and_none_oversized(core: Coordinator) -> None:
    """A peer reports its ``REPORTED_RECEIPTS`` smallest members' receipts; a report that
    carries more, or an oversized one, is refused as malformed and records nothing (a receipt
    is checked by signature: unbounded, every report could cost the coordinator thousands)."""
    run = run_prefix(core.digest)
    reporter = join(core, T0)
    members = [join(core, T0) for _ in range(REPORTED_RECEIPTS + 2)]
    receipts = {m.public_key.id: _receipt(m, reporter, run=run) for m in members}
    kept = reported(receipts)
    assert list(kept) == sorted(receipts)[:REPORTED_RECEIPTS]
    for carried in (
        {m.public_key.id: receipts[m.public_key.id] for m in members},
        {members[0].public_key.id: bytes(MAX_RECEIPT_BYTES + 1)},
    ):
        group = [pb.GroupMember(public_key=reporter.public_key.raw, weight=SAMPLES)] + [
            pb.GroupMember(public_key=m.public_key.raw, weight=SAMPLES, receipt=carried.get(m.public_key.id, b""))
            for m in members
        ]
        with pytest.raises(MalformedMessageError, match="receipt"):
            report(core, reporter, T0 + 10, round=ROUND, samples=SAMPLES, compute_s=9.0, state_digest="d", group=group)
    assert core.store.claims() == []


def test_a_sender_keeps_a_reducers_receipt_only_if_it_is_not_oversized() -> None:
    """A hostile reducer's reply may carry anything in its receipt field: a sender keeps at most
    ``MAX_RECEIPT_BYTES`` of it (the coordinator judges the rest), and a reply without one
    carries none."""
    from hivemind.proto import averaging_pb2

    from engine.receipts import attach, taken

    reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
    assert taken(reply) == b""
    assert taken(attach(reply, b"r" * MAX_RECEIPT_BYTES)) == b"r" * MAX_RECEIPT_BYTES
    assert taken(attach(reply, b"r" * (MAX_RECEIPT_BYTES + 1))) == b""
