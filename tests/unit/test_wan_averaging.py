"""The averaging-only WAN benchmark: its arithmetic and the arguments it refuses."""

from __future__ import annotations

import pytest

from benchmarks.wan_averaging import parse_args, per_pair_bytes, summarize
from benchmarks.wan_figures import link_bound_s


def test_each_link_carries_what_a_bandwidth_optimal_all_reduce_puts_on_it() -> None:
    values, peers = 10_400_000, 4
    per_link = per_pair_bytes(values, "none", peers) * (peers - 1)
    assert per_link == 2 * (peers - 1) * values * 4 // peers
    bound = link_bound_s(peers=peers, params=values, codec="none", link_bps=50e6)
    assert per_link * 8 / 50e6 == pytest.approx(bound)


def test_summary_compares_every_transport_with_the_baselines_of_the_same_run() -> None:
    rounds = {"tcp": [10.0, 12.0, 11.0], "libp2p": [11.0, 12.0], "swarmtrain": [13.0, 11.0, 12.0]}
    summary = summarize(rounds, bound_s=9.0)
    assert summary["tcp"]["median_s"] == 11.0
    assert summary["libp2p"]["median_s"] == 11.5
    assert summary["swarmtrain"]["pct_of_link_bound"] == pytest.approx(75.0)
    assert summary["swarmtrain"]["pct_of_tcp"] == pytest.approx(100 * 11 / 12)
    assert summary["swarmtrain"]["pct_of_libp2p"] == pytest.approx(100 * 11.5 / 12)
    assert "pct_of_tcp" not in summary["tcp"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peers", "1"], "--peers must be at least 2"),
        (["--rounds", "0"], "must be positive"),
        (["--streams", "0"], "--streams in 1..16"),
        (["--link", "fast"], "fast"),
        (["--codec", "zip"], "invalid choice"),
        (["--only", "udp"], "invalid choice"),
        (["--delay-ms", "-5"], "must not be negative"),
        (["--delay-ms", "nan"], "must be finite"),
        (["--delay-ms", "soon"], "invalid float value"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_set_up(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_busy_is_the_share_of_ticks_not_idle_between_two_readings() -> None:
    from benchmarks.wan_averaging import busy_pct, cpu_ticks

    assert busy_pct((100, 1000), (400, 2000)) == 30.0
    assert busy_pct((5, 10), (5, 10)) == 0.0
    busy, total = cpu_ticks()
    assert 0 <= busy <= total


def test_a_round_is_the_slowest_hosts_and_one_that_failed_anywhere_is_left_out() -> None:
    from benchmarks.wan_averaging import slowest_host

    assert slowest_host([[1.0, None, 3.0], [2.0, 5.0, 1.0]]) == [2.0, 3.0]
    assert slowest_host([[None], [1.0]]) == []


def test_tcp_counters_are_read_from_a_namespaces_snmp_table() -> None:
    from benchmarks.wan_averaging import tcp_counters

    snmp = (
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm RtoMin InSegs OutSegs RetransSegs InErrs\nTcp: 1 200 900 1000 25 0\n"
        "Udp: InDatagrams\nUdp: 3\n"
    )
    assert tcp_counters(snmp) == (1000, 25)
    with open("/proc/net/snmp") as table:  # this machine's own: the fields exist where it runs
        sent, retransmitted = tcp_counters(table.read())
    assert 0 <= retransmitted <= sent
