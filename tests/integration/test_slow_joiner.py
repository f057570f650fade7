"""A volunteer on a link 10x slower than the swarm's joins it while it runs: its state download
spans at least 5 rounds, yet it holds the swarm's state after one download, rolled forward by
the rounds' kept updates (``benchmarks.slow_join``), within three rounds of the download's end
(measured 1.0-1.8).
Without kept updates it downloaded state after state (``make bench-join``). Its first
contribution is not asserted here: issue #49 aims at its download plus two rounds, measured
3.4-4.5 rounds of 3.2 s in two runs of three and none in 150 s in the third (ARCHITECTURE Known
gaps 10). In network namespaces; needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.slow_join import run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_a_newcomer_whose_download_spans_rounds_gets_in_with_one_download(tmp_path: Path) -> None:
    join = run(tmp_path, subnet="10.79.8.0/24", until_adopted=True)
    assert join.downloads == 1, f"it chased the swarm: {join}"
    assert join.spans >= 5, f"the download spanned {join.spans:.1f} rounds, not the 5 this test is about: {join}"
    assert join.rolled >= 1, join
    assert join.adopted_s is not None and join.adopted_s <= join.download_s + 3 * join.round_s, join
