"""The coordinator load benchmark's arguments, percentiles and report (its runs need minutes)."""

from __future__ import annotations

import pytest

from benchmarks.coordinator_load import markdown, parse_args, percentile


def test_peers_must_fill_whole_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--peers", "8", "2000"]).peers == [8, 2000]
    with pytest.raises(SystemExit):
        parse_args(["--peers", "10"])
    assert "multiples of 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--duration", "0"])


def test_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0 and percentile(values, 0.99) == 100.0
    assert percentile([], 0.5) != percentile([], 0.5)  # nan


def test_report_lists_every_run() -> None:
    run = {
        "peers": 2000,
        "heartbeats_per_s": 400.0,
        "p50_ms": 3.0,
        "p99_ms": 40.0,
        "max_ms": 90.0,
        "p99_first_half_ms": 41.0,
        "p99_second_half_ms": 39.0,
        "report_p50_ms": 800.0,
        "report_p99_ms": 4000.0,
        "cpu_share": {"coordinator": 0.6, "heartbeats": 0.3},
        "load_cpu_share": 0.5,
        "sent_late_p99_ms": 12.0,
        "claims_granted_in_full": 8000,
        "claims": 8000,
        "errors": {"report DEADLINE_EXCEEDED": 3},
        "peers_online": 2000,
        "rows_per_hour": {"claims": 240000.0},
    }
    text = markdown([run], "header")
    row = "| this tree | 2000 | 400 | 3.0 | 40.0 | 90 | 41.0 / 39.0 | 800 / 4000 | 60% | 30% | 50% | 12 | 8000 of 8000 | 3 | 2000 |"
    assert row in text
    assert "this tree, 2000 peers: claims 240,000" in text
    assert "this tree, 2000 peers: {'report DEADLINE_EXCEEDED': 3}" in text
