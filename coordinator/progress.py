"""How far a run is and when it ends, from the spec's end and the swarm's pace: what the
dashboard's tokens/s and ETA show.

A run ends at ``schedule.total_tokens`` (its learning-rate schedule runs out there) or, failing
that, at ``rounds.max_rounds``; a run with neither runs until its operator stops it (no ETA).
The ETA divides what is left by the current pace (tokens/s for a token target, rounds/h for a
round target): it says when the run ends if the swarm keeps its pace, and says nothing while
the swarm is idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.spec import RunSpec

__all__ = ["RunProgress", "run_progress"]


@dataclass(frozen=True)
class RunProgress:
    tokens_per_sample: int | None
    """Tokens of one training sample (None: an imported task that does not say)."""
    tokens_trained: int
    """Granted samples x tokens per sample (0 when unknown)."""
    tokens_per_second: float
    """The swarm's samples/s x tokens per sample (0 when unknown)."""
    end: Literal["tokens", "rounds", "none"]
    """What ends the run: the schedule's total tokens, the spec's max rounds, or nothing."""
    target: int | None
    """The total tokens or the last round (None: no end)."""
    fraction: float | None
    """How much of the run is done, 0 to 1 (None: no end)."""
    eta_s: float | None
    """Seconds to the end at the current pace (0 at the end; None: no end, or the swarm idle)."""


def run_progress(
    spec: RunSpec, *, current_round: int, granted_samples: int, samples_per_second: float, rounds_per_hour: float
) -> RunProgress:
    per_sample = spec.sequence_length()
    trained = granted_samples * (per_sample or 0)
    tokens_per_s = samples_per_second * (per_sample or 0)
    total_tokens, max_rounds = spec.schedule.total_tokens, spec.rounds.max_rounds
    if total_tokens is not None and per_sample:
        left = max(0, total_tokens - trained)
        eta = 0.0 if left == 0 else (left / tokens_per_s if tokens_per_s > 0 else None)
        return RunProgress(
            per_sample, trained, tokens_per_s, "tokens", total_tokens, min(1.0, trained / total_tokens), eta
        )
    if max_rounds is not None:
        left_rounds = max(0, max_rounds - current_round)
        eta = 0.0 if left_rounds == 0 else (3600.0 * left_rounds / rounds_per_hour if rounds_per_hour > 0 else None)
        return RunProgress(
            per_sample, trained, tokens_per_s, "rounds", max_rounds, min(1.0, current_round / max_rounds), eta
        )
    return RunProgress(per_sample, trained, tokens_per_s, "none", None, None, None)
