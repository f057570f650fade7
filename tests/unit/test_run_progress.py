"""The run's progress and ETA (``coordinator.progress``): by the schedule's tokens, else by the
spec's last round, else none; nothing while the swarm is idle."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.progress import run_progress
from protocol.spec import load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_token_run_ends_at_its_schedules_tokens() -> None:
    spec = load_spec(EXAMPLES / "llama-1b.toml")
    total = spec.schedule.total_tokens
    assert total is not None
    half = total // 2 // 2048
    progress = run_progress(spec, current_round=9, granted_samples=half, samples_per_second=10.0, rounds_per_hour=4.0)
    assert (progress.end, progress.target, progress.tokens_per_sample) == ("tokens", total, 2048)
    assert progress.tokens_per_second == 20480.0
    assert progress.eta_s == pytest.approx((total - half * 2048) / 20480.0)
    assert progress.fraction == pytest.approx(0.5, abs=1e-3)
    idle = run_progress(spec, current_round=9, granted_samples=half, samples_per_second=0.0, rounds_per_hour=0.0)
    assert idle.eta_s is None
    done = run_progress(spec, current_round=9, granted_samples=total, samples_per_second=0.0, rounds_per_hour=0.0)
    assert (done.eta_s, done.fraction) == (0.0, 1.0)


def test_a_run_with_max_rounds_ends_there_and_one_without_never() -> None:
    text = (EXAMPLES / "demo.toml").read_text()
    spec = parse_spec(text.replace("max_rounds = 12", "max_rounds = 100", 1))
    progress = run_progress(spec, current_round=40, granted_samples=10, samples_per_second=5.0, rounds_per_hour=360.0)
    assert (progress.end, progress.target, progress.fraction) == ("rounds", 100, 0.4)
    assert progress.eta_s == pytest.approx(600.0)  # 60 rounds at 10 s
    endless = run_progress(
        parse_spec(text.replace("max_rounds = 12", "", 1)),
        current_round=40,
        granted_samples=10,
        samples_per_second=5.0,
        rounds_per_hour=360.0,
    )
    assert (endless.end, endless.eta_s, endless.fraction) == ("none", None, None)
    assert endless.tokens_per_second == 5.0 * spec.task.model.context
