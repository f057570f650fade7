"""A volunteer on a link 10x slower than the swarm's joins it while it runs: its state download
spans at least 5 rounds, yet it downloads one state and contributes within its download time
plus four rounds (``benchmarks.slow_join``: members keep the rounds' averaged updates and the
newcomer rolls the state it downloaded forward by them). Issue #49 aims at two rounds; measured
here 3.7 (``benchmarks/results/slow-join-*.md``): the roll's reads of the records and its
requests over the slow link, and a first round joined with nothing to contribute when the
members' phase is nearly over, take the rest. Without kept updates it chased the swarm. In
network namespaces; needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.slow_join import run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_a_newcomer_whose_download_spans_rounds_gets_in_with_one_download_and_contributes(tmp_path: Path) -> None:
    join = run(tmp_path, subnet="10.79.8.0/24")
    assert join.downloads == 1, f"it chased the swarm: {join}"
    assert join.spans >= 5, f"the download spanned {join.spans:.1f} rounds, not the 5 this test is about: {join}"
    assert join.rolled >= 1, join
    assert join.first_contribution_s is not None, f"it never contributed: {join}"
    assert join.first_contribution_s <= join.download_s + 4 * join.round_s, join
