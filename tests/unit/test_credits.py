"""RoundLedger: claims are granted only for attested, plausible work; each decided once."""

from __future__ import annotations

import math

import pytest

from coordinator.credits import ClaimStatus, ClaimVerdict, GroupMemberView, RoundClaim, RoundLedger

GOOD = "sha256:good"


def _claim(
    key: str,
    group: dict[str, float],
    *,
    samples: int | None = None,
    round: int = 1,
    digest: str = GOOD,
    duration_s: float = 10.0,
    received_at: float = 0.0,
) -> RoundClaim:
    members = tuple(GroupMemberView(key=k, weight=w) for k, w in group.items())
    return RoundClaim(
        key=key,
        round=round,
        samples=group.get(key, 0) if samples is None else samples,  # type: ignore[arg-type]
        group=members,
        state_digest=digest,
        duration_s=duration_s,
        received_at=received_at,
    )


def _ledger(max_sps: float = 1000.0, finalize_after_s: float = 60.0) -> RoundLedger:
    return RoundLedger(max_samples_per_second=max_sps, finalize_after_s=finalize_after_s)


def _by_key(decisions: list[ClaimVerdict]) -> dict[str, ClaimVerdict]:
    return {d.key: d for d in decisions}


HONEST = {"a": 100, "b": 160, "c": 120}


def test_honest_group_of_three_all_granted() -> None:
    ledger = _ledger()
    for key in HONEST:
        ledger.add(_claim(key, HONEST))
    decisions = ledger.tick(1.0)
    assert [d.key for d in decisions] == ["a", "b", "c"]
    assert all(d.status == ClaimStatus.GRANTED and d.round == 1 for d in decisions)
    assert [d.granted_samples for d in decisions] == [100, 160, 120]
    assert _by_key(decisions)["b"].reason == (
        "granted 160 samples: attested by 2 of 2 group members, digest matches the group's"
    )


def test_round_waits_until_complete() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", HONEST))
    ledger.add(_claim("b", HONEST))
    assert ledger.tick(30.0) == []
    assert ledger.pending() == 2
    ledger.add(_claim("c", HONEST, received_at=30.0))
    assert len(ledger.tick(31.0)) == 3
    assert ledger.pending() == 0


def test_over_reporter_granted_only_the_attested_median() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", HONEST))
    ledger.add(_claim("b", HONEST | {"b": 1000}, samples=1000))  # b inflates itself
    ledger.add(_claim("c", HONEST))
    b = _by_key(ledger.tick(1.0))["b"]
    assert (b.status, b.granted_samples) == (ClaimStatus.GRANTED, 160)
    assert b.reason.startswith("granted 160 samples: claimed 1000, attested 160 (median) by 2 of 2 group members")


def test_median_of_attested_weights_is_rounded_down() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", {"a": 10, "b": 1000, "c": 10}))
    ledger.add(_claim("b", {"a": 10, "b": 101, "c": 10}, samples=1000))
    ledger.add(_claim("c", {"a": 10, "b": 100.5, "c": 10}))
    assert _by_key(ledger.tick(1.0))["b"].granted_samples == 550  # median(101, 1000) = 550.5


def test_peer_with_different_digest_denied() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", HONEST))
    ledger.add(_claim("b", HONEST))
    ledger.add(_claim("c", HONEST, digest="sha256:forged"))
    decisions = _by_key(ledger.tick(1.0))
    c = decisions["c"]
    assert (c.status, c.granted_samples) == (ClaimStatus.DENIED, 0)
    assert c.reason.startswith("digest differs from the group's")
    # c is out of consensus, so it is no witness: a and b are attested by one member each
    assert decisions["a"].status == ClaimStatus.GRANTED
    assert "attested by 1 of 2 group members" in decisions["a"].reason


def test_no_majority_digest_denies_everyone() -> None:
    group = {"a": 100, "b": 100}
    ledger = _ledger()
    ledger.add(_claim("a", group, digest="sha256:one"))
    ledger.add(_claim("b", group, digest="sha256:two"))
    decisions = ledger.tick(1.0)
    assert [d.status for d in decisions] == [ClaimStatus.DENIED, ClaimStatus.DENIED]
    assert all("no majority digest" in d.reason for d in decisions)


def test_peer_nobody_attests_denied() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", {"a": 100, "b": 100}))
    ledger.add(_claim("b", {"a": 100, "b": 100}))
    ledger.add(_claim("x", {"x": 500, "a": 100}, samples=500))  # a and b never saw x
    decisions = _by_key(ledger.tick(1.0))
    assert decisions["x"].status == ClaimStatus.DENIED
    assert decisions["x"].reason.startswith("no group member of another account attests it")
    assert decisions["a"].status == decisions["b"].status == ClaimStatus.GRANTED


def test_peer_alone_denied() -> None:
    ledger = _ledger()
    ledger.add(_claim("solo", {"solo": 300}))
    (decision,) = ledger.tick(1.0)
    assert (decision.status, decision.granted_samples) == (ClaimStatus.DENIED, 0)
    assert decision.reason.startswith("averaged with nobody")


def test_throughput_cap_binds() -> None:
    ledger = _ledger(max_sps=10.0)
    for key in HONEST:
        ledger.add(_claim(key, HONEST, duration_s=12.5))  # cap: floor(10 * 12.5) = 125
    decisions = _by_key(ledger.tick(1.0))
    assert [decisions[k].granted_samples for k in "abc"] == [100, 125, 120]
    assert decisions["b"].reason == (
        "granted 125 samples: claimed 160, attested by 2 of 2 group members, "
        "throughput cap 125 (10 samples/s over 12.5 s), digest matches the group's"
    )


def test_both_caps_named_when_they_tie() -> None:
    ledger = _ledger(max_sps=16.0)  # cap: floor(16 * 10) = 160, the attested median too
    for key in HONEST:
        ledger.add(_claim(key, HONEST, samples=500 if key == "b" else None))
    b = _by_key(ledger.tick(1.0))["b"]
    assert b.granted_samples == 160
    assert "attested 160 (median)" in b.reason and "throughput cap 160" in b.reason


def test_incomplete_round_decided_after_finalize_after_s() -> None:
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", HONEST, received_at=100.0))
    ledger.add(_claim("b", HONEST, received_at=130.0))  # c never reports
    assert ledger.tick(159.9) == []
    decisions = ledger.tick(160.0)
    assert [(d.key, d.status, d.granted_samples) for d in decisions] == [
        ("a", ClaimStatus.GRANTED, 100),
        ("b", ClaimStatus.GRANTED, 160),
    ]
    assert "attested by 1 of 2 group members" in decisions[0].reason


def test_late_claim_for_a_decided_round_is_decided_against_its_claims() -> None:
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", HONEST, received_at=0.0))
    ledger.add(_claim("b", HONEST, received_at=0.0))
    assert len(ledger.tick(60.0)) == 2
    ledger.add(_claim("c", HONEST, received_at=65.0))
    (late,) = ledger.tick(66.0)
    assert (late.key, late.status, late.granted_samples) == ("c", ClaimStatus.GRANTED, 120)
    assert ledger.tick(67.0) == []


def test_duplicate_claim_rejected_even_after_decision() -> None:
    ledger = _ledger()
    for key in HONEST:
        ledger.add(_claim(key, HONEST))
    with pytest.raises(ValueError, match="second claim by a for round 1"):
        ledger.add(_claim("a", HONEST, samples=5))
    ledger.tick(1.0)
    with pytest.raises(ValueError, match="second claim by a for round 1"):
        ledger.add(_claim("a", HONEST))
    ledger.add(_claim("a", HONEST, round=2))  # another round is fine


def test_forgotten_rounds_are_closed() -> None:
    ledger = RoundLedger(max_samples_per_second=1000.0, finalize_after_s=10.0, retain_s=100.0)
    for key in HONEST:
        ledger.add(_claim(key, HONEST, round=3))
    ledger.tick(1.0)
    ledger.tick(100.0)
    with pytest.raises(ValueError, match="round 3 is closed"):
        ledger.add(_claim("a", HONEST, round=3))
    ledger.add(_claim("a", HONEST, round=4))


def test_a_forgotten_far_future_round_closes_no_other_round() -> None:
    """A lone claim for round 2**31 - 1 is denied and forgotten like any other; the rounds the
    swarm is at stay open (issue #14: one denied report closed every round below it)."""
    ledger = RoundLedger(max_samples_per_second=1000.0, finalize_after_s=10.0, retain_s=100.0)
    ledger.add(_claim("x", {"x": 10**12}, round=2**31 - 1))
    assert ledger.tick(11.0)[0].status == ClaimStatus.DENIED
    ledger.tick(200.0)
    for key in HONEST:
        ledger.add(_claim(key, HONEST, round=5, received_at=200.0))
    assert all(d.status == ClaimStatus.GRANTED for d in ledger.tick(201.0))


def test_each_claim_decided_once_across_repeated_ticks() -> None:
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", HONEST, round=1))
    ledger.add(_claim("a", HONEST, round=2, received_at=50.0))
    seen: list[tuple[str, int]] = []
    for now in [0.0, 59.0, 60.0, 61.0, 109.0, 110.0, 200.0, 200.0]:
        if now == 61.0:
            for key in ("b", "c"):
                ledger.add(_claim(key, HONEST, round=2, received_at=now))
        seen += [(d.key, d.round) for d in ledger.tick(now)]
    assert sorted(seen) == [("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert len(set(seen)) == len(seen)


def test_decisions_sorted_by_round_then_key() -> None:
    ledger = _ledger()
    for round in (2, 1):
        for key in ("c", "a", "b"):
            ledger.add(_claim(key, HONEST, round=round))
    assert [(d.round, d.key) for d in ledger.tick(1.0)] == [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]


def test_zero_attested_is_denied() -> None:
    ledger = _ledger()
    ledger.add(_claim("a", {"a": 100, "b": 0}))
    ledger.add(_claim("b", {"a": 100, "b": 50}, samples=50))
    decisions = _by_key(ledger.tick(1.0))
    assert decisions["b"].status == ClaimStatus.DENIED
    assert decisions["b"].reason.startswith("nothing to grant")
    assert decisions["a"].granted_samples == 100


@pytest.mark.parametrize(
    ("field", "claim"),
    [
        ("samples", _claim("a", HONEST, samples=-1)),
        ("round", _claim("a", HONEST, round=-1)),
        ("duration_s", _claim("a", HONEST, duration_s=0.0)),
        ("duration_s", _claim("a", HONEST, duration_s=math.inf)),
        ("received_at", _claim("a", HONEST, received_at=math.nan)),
        ("weight", _claim("a", HONEST | {"b": math.nan})),
        ("weight", _claim("a", HONEST | {"b": -3.0})),
        ("state_digest", _claim("a", HONEST, digest="")),
        ("reporter", _claim("z", HONEST, samples=5)),
        (
            "twice",
            RoundClaim(
                key="a",
                round=1,
                samples=1,
                state_digest=GOOD,
                duration_s=1.0,
                received_at=0.0,
                group=(GroupMemberView("a", 1.0), GroupMemberView("b", 1.0), GroupMemberView("b", 2.0)),
            ),
        ),
        (
            "group",
            RoundClaim(key="a", round=1, samples=1, group=(), state_digest=GOOD, duration_s=1.0, received_at=0.0),
        ),
    ],
)
def test_malformed_claims_rejected(field: str, claim: RoundClaim) -> None:
    ledger = _ledger()
    with pytest.raises(ValueError, match=field):
        ledger.add(claim)
    assert ledger.pending() == 0


def test_ledger_config_validated() -> None:
    with pytest.raises(ValueError, match="max_samples_per_second"):
        RoundLedger(max_samples_per_second=0.0)
    with pytest.raises(ValueError, match="finalize_after_s"):
        RoundLedger(max_samples_per_second=1.0, finalize_after_s=math.nan)


def _accusing(key: str, group: dict[str, float], offences: dict[str, str]) -> RoundClaim:
    claim = _claim(key, group)
    members = tuple(GroupMemberView(key=m.key, weight=m.weight, offence=offences.get(m.key, "")) for m in claim.group)
    return RoundClaim(**{**claim.__dict__, "group": members})


def test_a_member_bounded_by_most_attesters_reducers_is_denied() -> None:
    """Robust averaging clipped d's parts at three reducers: a clipped contribution is not
    attested work, whatever d claims."""
    group = {"a": 100, "b": 100, "c": 100, "d": 100}
    why = {"d": "part norm 9.1e+03 clipped to 3x the group's median 91 (in 8 of 8 parts)"}
    ledger = _ledger()
    for key in "abc":
        ledger.add(_accusing(key, group, why))
    ledger.add(_claim("d", group))
    decisions = _by_key(ledger.tick(1.0))
    assert decisions["d"].status == ClaimStatus.DENIED
    assert "bounded by 3 of 3 attesting members' robust averaging (a: part norm" in decisions["d"].reason
    assert all(decisions[k].status == ClaimStatus.GRANTED for k in "abc")


def test_one_accuser_alone_cannot_deny_an_honest_member() -> None:
    group = {"a": 100, "b": 100, "c": 100, "d": 100}
    ledger = _ledger()
    ledger.add(_accusing("d", group, {"a": "made up"}))
    for key in "abc":
        ledger.add(_claim(key, group))
    decisions = _by_key(ledger.tick(1.0))
    assert decisions["a"].status == ClaimStatus.GRANTED


@pytest.mark.parametrize(("offence", "needle"), [("x" * 301, "<= 300 chars"), ("a\x00b", "NUL")])
def test_a_malformed_offence_is_refused(offence: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _ledger().add(_accusing("a", HONEST, {"b": offence}))


def test_nodes_of_one_account_do_not_attest_each_other() -> None:
    """Two nodes of account "acc" vouch for each other; a third member of another account
    attests them. Within the account nothing counts; across accounts it counts once."""
    group = {"n1": 100, "n2": 100, "h": 100}
    ledger = _ledger()
    for key in ("n1", "n2"):
        ledger.add(RoundClaim(**{**_claim(key, group).__dict__, "account": "acc"}))
    decisions = _by_key(ledger.tick(100.0))
    assert decisions["n1"].status == ClaimStatus.DENIED
    assert "no group member of another account attests it" in decisions["n1"].reason
    ledger = _ledger()
    for key in ("n1", "n2"):
        ledger.add(RoundClaim(**{**_claim(key, group, round=2).__dict__, "account": "acc"}))
    ledger.add(_claim("h", group, round=2))
    decisions = _by_key(ledger.tick(100.0))
    assert decisions["n1"].status == ClaimStatus.GRANTED and "attested by 1 of 2" in decisions["n1"].reason
    assert decisions["h"].status == ClaimStatus.GRANTED and "attested by 1 of 2" in decisions["h"].reason


# --- in absentia: a member whose report never came -------------------------------------------

GROUP_OF_FOUR = {"a": 100, "b": 160, "c": 120, "gone": 90}
KNOWN = {"a": ("a", 0.0), "b": ("b", 0.0), "c": ("c", 0.0), "gone": ("gone", 0.0), "ally": ("acc-a", 0.0)}


def _member_of(key: str, round_: int) -> tuple[str, float] | None:
    return KNOWN.get(key)


def test_a_member_killed_after_its_round_is_credited_in_absentia() -> None:
    """Three of four report; the fourth was killed after the round landed. At finalisation its
    witnesses' attested median is granted, and its own report arriving later is a second claim."""
    ledger = _ledger(finalize_after_s=60.0)
    for key in ("a", "b", "c"):
        ledger.add(_claim(key, GROUP_OF_FOUR, duration_s=10.0))
    assert ledger.tick(59.0, _member_of) == []
    decisions = _by_key(ledger.tick(60.0, _member_of))
    assert sorted(decisions) == ["a", "b", "c", "gone"]
    gone = decisions["gone"]
    assert (gone.status, gone.granted_samples, gone.claimed_samples) == (ClaimStatus.GRANTED, 90, 0)
    assert gone.reason == (
        "granted 90 samples in absentia: its own report never came; attested 90 (median) by 3 of 3 group members, "
        "digest the group's"
    )
    assert gone.in_absentia is not None and gone.in_absentia.state_digest == GOOD
    assert ledger.has("gone", 1)
    with pytest.raises(ValueError, match="a second claim"):
        ledger.add(_claim("gone", GROUP_OF_FOUR, received_at=70.0))
    assert ledger.tick(200.0, _member_of) == []


def test_in_absentia_takes_the_median_and_the_witnesses_throughput_cap() -> None:
    ledger = _ledger(max_sps=5.0, finalize_after_s=60.0)
    for key, said in (("a", 90), ("b", 400), ("c", 60)):  # b inflates what "gone" did
        ledger.add(_claim(key, {**GROUP_OF_FOUR, "gone": said}, duration_s=10.0))
    gone = _by_key(ledger.tick(60.0, _member_of))["gone"]
    assert gone.granted_samples == 50  # cap 5 samples/s over the witnesses' median 10 s < median 90
    assert "throughput cap 50" in gone.reason


def test_one_witness_credits_nobody_in_absentia() -> None:
    """A member alone cannot mint credit for a key it names (an ally, or a key of its own
    account's friend): at least two accounts must attest a member that never reported."""
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", {"a": 100, "b": 100, "ally": 500}))
    ledger.add(_claim("b", {"a": 100, "b": 100}))
    decisions = _by_key(ledger.tick(60.0, _member_of))
    assert "ally" not in decisions
    assert not ledger.has("ally", 1)


def test_a_name_the_run_never_admitted_is_credited_nothing() -> None:
    ledger = _ledger(finalize_after_s=60.0)
    group = {"a": 100, "b": 100, "c": 100, "stranger": 100}
    for key in ("a", "b", "c"):
        ledger.add(_claim(key, group))
    assert "stranger" not in _by_key(ledger.tick(60.0, _member_of))


def test_witnesses_of_the_absent_members_own_account_do_not_count() -> None:
    """ "ally" earns for account acc-a; only a's node of that account and one outsider name it."""
    ledger = _ledger(finalize_after_s=60.0)
    group = {"a": 100, "b": 100, "ally": 100}
    ledger.add(RoundClaim(**{**_claim("a", group).__dict__, "account": "acc-a"}))
    ledger.add(_claim("b", group))
    assert "ally" not in _by_key(ledger.tick(60.0, _member_of))


def test_in_absentia_needs_the_groups_majority_digest_and_no_majority_of_accusers() -> None:
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", GROUP_OF_FOUR, digest="sha256:a"))
    ledger.add(_claim("b", GROUP_OF_FOUR, digest="sha256:b"))
    assert "gone" not in _by_key(ledger.tick(60.0, _member_of))  # a tie: no state to be credited in
    ledger = _ledger(finalize_after_s=60.0)
    for key in ("a", "b"):
        ledger.add(_accusing(key, GROUP_OF_FOUR, {"gone": "clipped: norm 40 > 4"}))
    ledger.add(_claim("c", GROUP_OF_FOUR))
    assert "gone" not in _by_key(ledger.tick(60.0, _member_of))


def test_a_pair_that_loses_one_member_credits_neither() -> None:
    """A group of two where one was killed: the survivor has no witness, and one witness credits
    nobody in absentia (the price of not letting one member mint credit for a name)."""
    ledger = _ledger(finalize_after_s=60.0)
    ledger.add(_claim("a", {"a": 100, "gone": 90}))
    decisions = _by_key(ledger.tick(60.0, _member_of))
    assert decisions["a"].status == ClaimStatus.DENIED and "gone" not in decisions
