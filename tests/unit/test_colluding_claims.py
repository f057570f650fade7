"""Colluding minted keys with extreme self-reported numbers (issue #14's coordinator fuzzing):
they gain no more credit than the spec's cap allows for the time the coordinator observed,
out-of-range values are refused without changing anything, and the ledger, the credit
figures and ``/metrics`` keep working while honest claims keep being granted."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from coordinator.http.metrics import render_metrics
from protocol.errors import MalformedMessageError
from tests.conftest import plain
from tests.unit.claim_calls import group, heartbeat, join, report
from tests.unit.conftest import new_core

CAP = 100.0
SPEC = f'[run]\nname = "collude"\n[credits]\nmax_samples_per_second = {CAP}\n'
T0 = 1_800_000_000.0
HONEST_SAMPLES = 50


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    made = new_core(tmp_path, SPEC)
    yield made
    made.store.close()


def test_colluders_get_at_most_the_cap_for_the_time_the_coordinator_saw(core: Coordinator) -> None:
    colluders = [join(core, T0), join(core, T0)]
    honest = [join(core, T0), join(core, T0), join(core, T0)]
    huge = 2**40  # the largest sample count a report may carry
    # out-of-range values are refused, naming the field, and recorded nowhere
    for bad in (
        {"round": 3, "samples": 2**62 - 1, "compute_s": 10.0},
        {"round": 3, "samples": 10, "compute_s": 1e300},
        {"round": 3, "samples": 10, "compute_s": math.inf},
        {"round": 2**31, "samples": 10, "compute_s": 10.0},
        {"round": 3, "samples": 10, "compute_s": 10.0, "state_digest": "d" * 200_000},
        {"round": 3, "samples": 10, "compute_s": 10.0, "state_digest": "a\x00b"},
    ):
        with pytest.raises(MalformedMessageError):
            report(core, colluders[0], T0 + 1, **{"state_digest": "x", "group": group(colluders, 1.0), **bad})
    assert core.store.claims() == []
    for round_ in (3, 4, 5):
        now = T0 + 10 * (round_ - 2)  # a round every 10 s on the coordinator's clock
        for peer in colluders:
            # each claims the most it may, for a week of compute, and vouches for the other
            report(
                core,
                peer,
                now,
                round=round_,
                samples=huge,
                compute_s=604800.0,
                state_digest="evil",
                group=group(colluders, huge),
            )
        for peer in honest:
            report(
                core,
                peer,
                now,
                round=round_,
                samples=HONEST_SAMPLES,
                compute_s=9.0,
                state_digest="good",
                group=group(honest, HONEST_SAMPLES),
            )
        core.tick(now=now + 61)
    by_peer = plain(core.store.credits_by_peer())
    for peer in colluders:
        credit = by_peer[peer.public_key.id]
        assert credit["samples"] <= 3 * CAP * 10 + 1, credit  # 3 rounds of 10 observed seconds
    for peer in honest:
        assert by_peer[peer.public_key.id] == {
            "samples": 3 * HONEST_SAMPLES,
            "flops": pytest.approx(by_peer[peer.public_key.id]["flops"]),
            "rounds": 3,
        }
    # the figures keep working and stay finite
    text = render_metrics(core, now=T0 + 200)
    assert "swarmtrain_credited_samples_total" in text and "inf" not in text.lower() and "nan" not in text.lower()
    assert core.store.leaderboard(limit=10)
    assert core.status(now=T0 + 200).current_round == 5


def test_an_absurd_heartbeat_is_refused_and_a_large_one_counts_at_most_the_cap(core: Coordinator) -> None:
    peers = [join(core, T0), join(core, T0)]
    with pytest.raises(MalformedMessageError, match="samples_per_second"):
        heartbeat(core, peers[0], T0 + 1, samples_per_second=1e308)
    with pytest.raises(MalformedMessageError, match="round"):
        heartbeat(core, peers[0], T0 + 1, round=2**40)
    for peer in peers:
        assert heartbeat(core, peer, T0 + 2, samples_per_second=1e11).admitted
    summary = core.health.summary(T0 + 3)
    assert summary.samples_per_second == 2 * CAP
    assert "inf" not in render_metrics(core, now=T0 + 3).lower()


def test_a_denied_far_future_report_does_not_move_the_current_round(core: Coordinator) -> None:
    honest = [join(core, T0), join(core, T0)]
    for peer in honest:
        report(core, peer, T0 + 10, round=7, samples=5, compute_s=5.0, state_digest="good", group=group(honest, 5))
    core.tick(now=T0 + 80)
    lone = join(core, T0)
    report(
        core, lone, T0 + 90, round=2**31 - 1, samples=5, compute_s=5.0, state_digest="x" * 512, group=group([lone], 5)
    )
    core.tick(now=T0 + 200)
    assert core.status(now=T0 + 200).current_round == 7
    for peer in honest:  # the swarm's next rounds are still open and granted
        report(core, peer, T0 + 210, round=8, samples=5, compute_s=5.0, state_digest="good2", group=group(honest, 5))
    core.tick(now=T0 + 300)
    assert all(c.status == "granted" for c in core.store.claims(round=8))


def test_accounts_younger_than_the_runs_minimum_attest_nobody(tmp_path: Path) -> None:
    """``credits.min_attester_age_s``: a pair of freshly minted keys vouching for each other earns
    nothing until the coordinator has known them that long; then their attestation counts."""
    aged = new_core(tmp_path, SPEC + "min_attester_age_s = 3600\n")
    try:
        pair = [join(aged, T0), join(aged, T0)]
        for member in pair:
            report(aged, member, T0 + 30, round=1, samples=10, compute_s=30.0, state_digest="d", group=group(pair, 10))
        for member in pair:  # an hour later, the same accounts attest
            report(
                aged, member, T0 + 3630, round=2, samples=10, compute_s=30.0, state_digest="d", group=group(pair, 10)
            )
        aged.tick(now=T0 + 4000)
        first = aged.store.claims(round=1)
        assert [c.status for c in first] == ["denied", "denied"]
        assert all("younger than the run's min_attester_age_s" in c.reason for c in first), first
        assert [c.status for c in aged.store.claims(round=2)] == ["granted", "granted"]
    finally:
        aged.store.close()
