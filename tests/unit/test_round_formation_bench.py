"""The round-formation benchmark's own arithmetic and argument checks (the measurement itself
runs real swarm members: ``make bench-rounds``)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.round_formation import growth, main, reducers, spread


def test_growth_compares_each_size_with_the_smallest() -> None:
    rows = [
        {"members": 16, "formation_s_median": 0.25, "bytes_per_member": 1000},
        {"members": 64, "formation_s_median": 2.0, "bytes_per_member": 1050},
    ]
    first, second = growth(rows)
    assert (first["n_ratio"], first["formation_ratio"], first["bytes_ratio"]) == (1.0, 1.0, 1.0)
    assert (second["n_ratio"], second["log_n_ratio"]) == (4.0, 1.5)
    assert (second["formation_ratio"], second["bytes_ratio"]) == (8.0, 1.05)


def test_growth_without_a_formation_time_says_none() -> None:
    rows = [
        {"members": 16, "formation_s_median": None, "bytes_per_member": 0},
        {"members": 64, "formation_s_median": 2.0, "bytes_per_member": 10},
    ]
    assert [(g["formation_ratio"], g["bytes_ratio"]) for g in growth(rows)] == [(None, None), (None, None)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "16,x"],
        ["--sizes", "1"],
        ["--rounds", "0"],
        ["--timeout", "0"],
        ["--spread", "-1"],
        ["--spread-per-member", "-0.1"],
    ],
)
def test_bad_arguments_are_one_clear_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_launch_spread_grows_with_the_swarm_when_asked() -> None:
    args = argparse.Namespace(spread=1.0, spread_per_member=0.0)
    assert spread(args, 128) == 1.0
    args.spread_per_member = 0.1
    assert (spread(args, 4), spread(args, 128)) == (1.0, 12.8)


def test_the_reducers_figure_says_how_many_members_reduce_every_fragment() -> None:
    # every member reduces a part of the benchmark's vector (since 2d7fb30), at any codec
    assert reducers(65536, 4, "fp16", 128) == 128
    assert reducers(65536, 4, "4bit", 16) == 16
    # a vector of fewer values than members: one member per value reduces, the rest only send
    assert reducers(64, 4, "fp16", 128) == 64
