"""A volunteer on a link 10x slower than the swarm's joins it while it runs
(``benchmarks.slow_join``: 220 kbit/s against 2.2 Mbit/s, rounds of an 8 s phase, sparse updates at
density 1/16, members that resumed the run at round 100 and keep the shipped 16 rounds of updates,
so that the newcomer cannot roll its initial state forward): its state download spans at least 5
rounds, yet it gets in with that one download, rolled forward by the rounds' kept updates, and
contributes (a round averaged into the swarm's state with its samples). Without kept updates it
downloads state after state and never gets in (``make bench-join``).

How soon is measured, not asserted (a timed bound is a benchmark's, and this one sits within a
second of what the round's timing allows: docs/design/joining.md, "Meeting the members' phase"): the
figures are printed, and issue #49's bound (a first contribution within the download plus two
rounds) is the benchmark's row. In network namespaces; needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.slow_join import run, timeline

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_a_newcomer_whose_download_spans_rounds_gets_in_with_one_download_and_contributes(tmp_path: Path) -> None:
    join = run(tmp_path, subnet="10.79.8.0/24")
    story = f"{join}\n{timeline(tmp_path)}"
    print(story)
    assert join.spans >= 5, f"the download spanned {join.spans:.1f} rounds, not the 5 this test is about: {story}"
    assert join.downloads == 1, f"it chased the swarm: {story}"
    assert join.rolled >= 1 and join.adopted_s is not None, f"it never rolled its download forward: {story}"
    assert join.first_contribution_s is not None, f"it never contributed: {story}"
