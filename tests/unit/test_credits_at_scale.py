"""A round of thousands of reporters is decided in time linear in its claims: each claim's
views (the claims whose group lists it) are looked up, not found by scanning every claim of the
round. The coordinator decides a round under its lock: at 10,000 reporters the scan (10^8
group lookups) held it for minutes and every report of the next round timed out
(``benchmarks/coordinator_load.py``). Verdicts are the scan's, claim for claim."""

from __future__ import annotations

import random

import pytest

from coordinator import credits
from coordinator.credits import GroupMemberView, RoundClaim, RoundLedger
from coordinator.store.claims import RoundClaim as StoredClaim

GROUP = 4


def round_of(reporters: int, seed: int) -> list[RoundClaim]:
    """``reporters`` claims of one round in groups of 4, with liars, dissenters, members that
    never report and claims listing only themselves."""
    rng = random.Random(seed)
    claims = []
    for first in range(0, reporters, GROUP):
        keys = [f"k{first + i:06d}" for i in range(GROUP)]
        digest = f"sha256:{first:08x}"
        for key in keys:
            if rng.random() < 0.05:  # never reports: credited in absentia or not
                continue
            group = [GroupMemberView(key=k, weight=float(rng.choice((16, 16, 64)))) for k in keys]
            if rng.random() < 0.02:
                group = [g for g in group if g.key == key]  # averaged with nobody
            claims.append(
                RoundClaim(
                    key=key,
                    round=1,
                    samples=int(rng.choice((16, 16, 200))),
                    group=tuple(group),
                    state_digest=digest if rng.random() > 0.05 else "sha256:dissent",
                    duration_s=10.0,
                    received_at=float(rng.random()),
                )
            )
    rng.shuffle(claims)
    return claims


def decided(claims: list[RoundClaim], *, by_scan: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    ledger = RoundLedger(max_samples_per_second=1000.0, finalize_after_s=5.0)
    with monkeypatch.context() as patch:
        if by_scan:  # what deciding was: every claim's views scanned from the whole round
            patch.setattr(credits._Round, "views", lambda self, key: None)
        for claim in claims:
            ledger.add(claim)
        verdicts = ledger.tick(10.0, member_of=lambda key, round_: ("", 0.0))
    return [(v.key, v.status, v.granted_samples, v.reason) for v in verdicts]


def test_a_round_is_decided_with_a_bounded_number_of_lookups_per_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    real = StoredClaim.weight_for

    def counted(self: StoredClaim, key: str) -> float | None:
        calls[0] += 1
        return real(self, key)

    monkeypatch.setattr(StoredClaim, "weight_for", counted)
    claims = round_of(2000, seed=1)
    ledger = RoundLedger(max_samples_per_second=1000.0, finalize_after_s=5.0)
    for claim in claims:
        ledger.add(claim)
    verdicts = ledger.tick(10.0, member_of=lambda key, round_: ("", 0.0))
    assert len(verdicts) >= len(claims)
    assert calls[0] <= 4 * GROUP * len(claims), calls[0]  # the scan made ~len(claims)**2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_verdicts_are_the_scans_claim_for_claim(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    claims = round_of(400, seed)
    indexed = decided(claims, by_scan=False, monkeypatch=monkeypatch)
    scanned = decided(claims, by_scan=True, monkeypatch=monkeypatch)
    assert indexed == scanned
    statuses = {v[1] for v in indexed}
    assert len(statuses) >= 2  # the round mixes granted and denied claims: the comparison bites
