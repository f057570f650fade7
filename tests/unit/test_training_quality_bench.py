"""The training-quality benchmark's in-process swarm (``benchmarks.loopback_group``) and its
spec handling: the reduction is the weighted mean without a rule or codec, the parts cover
the vector once, and a run is a pure function of its spec and seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.loopback_group import LoopbackGroup, RobustTally, reduce_group, reducer_ranges
from benchmarks.quality_runs import Setup, build_spec, run_inprocess, spec_text, to_toml
from benchmarks.training_quality import main, suites, worker_pool
from engine.codecs import get_codec
from engine.robust import RobustRule
from protocol.spec import parse_spec
from tests.specs import bare_spec

DEMO = (Path(__file__).resolve().parents[2] / "examples" / "demo.toml").read_text()
TINY = bare_spec("tiny", d_model=16, context=8, batch_size=2, inner_steps=3, compression="int8", min_group_size=2)


def test_without_rule_or_codec_the_group_gets_the_weighted_mean() -> None:
    vectors = [torch.randn(5000) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    got = reduce_group(
        vectors, weights, codec=get_codec("none"), rule=RobustRule.off(), streams=4, seed=0, tally=RobustTally()
    )
    want = sum(w * v for w, v in zip(weights, vectors)) / sum(weights)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize(("numel", "members", "codec"), [(135_000, 4, "int8"), (300_000, 3, "fp16"), (100, 8, "none")])
def test_the_parts_cover_the_vector_once(numel: int, members: int, codec: str) -> None:
    seen = torch.zeros(numel, dtype=torch.int32)
    for part in reducer_ranges(numel, members, get_codec(codec), 4):
        seen[part] += 1
    assert bool((seen == 1).all())


def test_the_robust_rule_is_tallied_on_honest_members() -> None:
    torch.manual_seed(0)
    common = torch.randn(4096)
    vectors = [common + 0.5 * torch.randn(4096) * (1 + i) for i in range(4)]
    tallies = {clip: RobustTally() for clip in (1.0, 2.0)}
    for clip, tally in tallies.items():
        rule = RobustRule(clip=clip)
        reduce_group(vectors, [1.0] * 4, codec=get_codec("int8"), rule=rule, streams=1, seed=0, tally=tally)
    parts = 4 * len(reducer_ranges(4096, 4, get_codec("int8"), 1))
    # clip = 1 x the lower median norm: the two members above it are scaled down in every part;
    # 2 x (the default) leaves these honest members whole
    assert tallies[1.0].parts == parts and tallies[1.0].clipped == parts // 2
    assert tallies[2.0].clipped == 0


def test_overrides_rewrite_the_spec_and_remove_keys() -> None:
    data = spec_text(
        DEMO, {"averaging": {"overlap": False}, "rounds": {"time_budget_s": None}, "task.model": {"d_model": 32}}
    )
    spec = parse_spec(to_toml(data))
    assert spec.averaging.overlap is False and spec.rounds.time_budget_s is None and spec.task.model.d_model == 32
    assert parse_spec(to_toml(spec_text(DEMO, {}))) == parse_spec(DEMO)
    built = build_spec(DEMO, Setup("x", 4), seed=7, rounds=3)
    assert (built.data.seed, built.rounds.max_rounds, built.eval.every_rounds) == (7, 3, 1)


@pytest.mark.parametrize(
    "overlap",
    [{"overlap": False}, {"overlap": True, "overlap_start": "eager"}, {"overlap": True, "overlap_start": "local"}],
)
def test_an_in_process_run_is_a_pure_function_of_spec_and_seed(overlap: dict[str, object]) -> None:
    setup = Setup("tiny", 2, {"averaging": overlap}, delay_steps=1)
    first = run_inprocess(TINY, setup, seed=3, rounds=3)
    again = run_inprocess(TINY, setup, seed=3, rounds=3)
    other = run_inprocess(TINY, setup, seed=4, rounds=3)
    assert len(first.val_loss) == 3 and first.val_loss == again.val_loss and first.val_loss != other.val_loss


def test_unknown_suites_are_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--suite", "headline,nonsense"])
    assert "nonsense" in capsys.readouterr().err
    assert {"headline", "outer", "hk", "codec", "overlap", "robust", "partial", "scale"} <= set(suites())


def test_a_dropped_update_weighs_nothing_and_one_member_always_counts() -> None:
    spec = parse_spec(TINY)
    group = LoopbackGroup(4, spec.averaging, seed=5, drop=0.5)
    rounds = [group._weights(r, [1.0, 2.0, 3.0, 4.0]) for r in range(200)]
    assert all(any(w) for w in rounds)
    assert all(w in (0.0, original) for ws in rounds for w, original in zip(ws, [1.0, 2.0, 3.0, 4.0]))
    dropped = sum(w == 0.0 for ws in rounds for w in ws)
    assert 300 < dropped < 500 and group.tally.dropped == dropped
    again = LoopbackGroup(4, spec.averaging, seed=5, drop=0.5)
    assert [again._weights(r, [1.0, 2.0, 3.0, 4.0]) for r in range(200)] == rounds
    assert LoopbackGroup(4, spec.averaging, seed=5)._weights(0, [1.0, 2.0]) == [1.0, 2.0]


def test_a_long_row_reads_its_gaps_off_the_curves_seed_by_seed() -> None:
    from benchmarks.training_quality import _gap_over_rounds

    def runs(*curves: list[float]) -> list[dict[str, object]]:
        return [{"val_loss": c} for c in curves]

    rounds = 64
    row = {
        "name": "long",
        "rounds": rounds,
        "h": 20,
        "runs": runs([2.2] * rounds, [1.1] * rounds),
        "references": {
            "sync_dp": runs([2.0] * rounds, [1.0] * rounds),
            "one_peer": runs([2.2] * rounds, [1.1] * rounds),
        },
    }
    lines = _gap_over_rounds([row, {**row, "rounds": 30}])  # a short row has no such table
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| round")]
    assert [line.split(" | ")[0] for line in body] == ["| 8", "| 16", "| 32", "| 64"]
    assert all("+10.00% ± 0.00 | +0.00% ± 0.00 | +10.00% ± 0.00" in line for line in body)
    assert "| 64 | 1280 |" in body[-1]


def test_runs_side_by_side_give_what_runs_one_after_another_give() -> None:

    from benchmarks.training_quality import Row, run_suite

    rows = [Row(Setup("tiny", 2, {}), k=2, h=3)]
    kwargs = {"seeds": [0, 1], "rounds": 2, "base": TINY, "swarm": False, "log": lambda _line: None}
    serial = run_suite("tiny", rows, **kwargs)  # type: ignore[arg-type]
    with worker_pool(2) as pool:
        side_by_side = run_suite("tiny", rows, pool=pool, **kwargs)  # type: ignore[arg-type]
    for summary in (serial, side_by_side):  # how long each took is the one thing that may differ
        for row in summary["rows"]:
            for run in [*row["runs"], *row["references"]["sync_dp"], *row["references"]["one_peer"]]:
                run.pop("wall_s")
    assert serial == side_by_side
    assert serial["rows"][0]["runs"][0]["val_loss"] != serial["rows"][0]["runs"][1]["val_loss"]
