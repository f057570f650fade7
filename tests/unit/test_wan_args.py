"""The WAN benchmark refuses arguments it cannot honour, before it sets anything up."""

from __future__ import annotations

import pytest

from benchmarks.wan import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--time-budget", "30"], "--time-budget applies to swarmtrain's configurations only"),
        (["--time-budget", "30", "--only", "fp32", "hivemind sync DP"], "the hivemind baselines count steps"),
        (["--time-budget", "-1", "--only", "fp32"], "--time-budget must be >= 0"),
    ],
)
def test_a_time_budget_is_refused_where_it_cannot_apply(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_every_node_configuration_is_a_configuration() -> None:
    from benchmarks.wan import CONFIGS, NODE_RANKS

    names = {name for name, *_ in CONFIGS}
    assert set(NODE_RANKS) <= names and all(ranks > 1 for ranks in NODE_RANKS.values())
