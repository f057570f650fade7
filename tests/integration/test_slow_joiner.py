"""A volunteer on a link 10x slower than the swarm's joins it while it runs: its state download
spans at least 5 rounds, yet it downloads one state and contributes within its download time
plus six rounds (``benchmarks.slow_join``: members keep the rounds' averaged updates and the
newcomer rolls the state it downloaded forward by them). Issue #49 aims at two rounds; measured
here 3.4-4.5 with rounds of 3.2 s (ARCHITECTURE Known gaps 10 says what takes the rest).
Without kept updates it downloaded state after state and never contributed. In network
namespaces; needs root."""

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
    assert join.first_contribution_s <= join.download_s + 6 * join.round_s, join
