"""What a peer shows its volunteer while it trains.

On a terminal: one live line, redrawn during the inner phase (a bar over the round's inner
steps or time budget, running loss, samples/s, the last group's size, the bytes sent so far
and, with a coordinator, the samples it credited) and while the peer waits for its averaging round; every completed round also leaves one
permanent line. Anywhere else (a pipe, a file, a log collector): only the permanent lines,
which is what scripts and the tests read.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

CLEAR_LINE = "\r\x1b[K"
BAR_WIDTH = 20


@dataclass(frozen=True)
class InnerProgress:
    """Where the inner phase of a round stands after one step."""

    round: int
    """The global round whose parameters this phase started from."""
    step: int
    """Inner steps done in this round."""
    steps: int | None
    """The round's inner steps H; None when only a time budget bounds it."""
    elapsed_s: float
    budget_s: float | None
    """The round's time budget; None when only H bounds it."""
    samples: int
    loss: float
    """Mean training loss of this round's steps so far."""

    @property
    def fraction(self) -> float:
        """How far through the round, 0..1: whichever bound comes first."""
        parts = [0.0]
        if self.steps:
            parts.append(self.step / self.steps)
        if self.budget_s:
            parts.append(self.elapsed_s / self.budget_s)
        return min(1.0, max(parts))


@dataclass(frozen=True)
class Credit:
    """This peer's credit as the coordinator's database has it."""

    samples: int
    """Granted: attested by the other members of its groups."""
    flops: float
    pending_samples: int
    """Claimed in round reports, not decided yet (decided once the round's group has reported)."""

    def describe(self) -> str:
        text = f"credited {self.samples:,} samples ({self.flops:.3g} FLOPs)"
        return text + (f", {self.pending_samples:,} pending" if self.pending_samples else "")


class ProgressSink(Protocol):
    """What the trainer tells about a round while it runs."""

    def inner_step(self, progress: InnerProgress) -> None: ...

    def waiting(self, round_: int) -> None: ...

    def joining(self, text: str) -> None:
        """Where this peer's join stands (state download, rolling forward), with how long it takes."""
        ...


class NoProgress:
    """Shows nothing (library use, tests)."""

    def inner_step(self, progress: InnerProgress) -> None:
        pass

    def waiting(self, round_: int) -> None:
        pass

    def joining(self, text: str) -> None:
        pass


def round_line(metrics: dict[str, Any]) -> str:
    """The permanent line of one completed round."""
    return (
        f"round {metrics['round']:>4} | loss {metrics['loss']:.4f} | "
        f"{metrics['samples'] / max(metrics['wall_s'], 1e-9):8.1f} samples/s | group {metrics['group_size']} | "
        f"sent {metrics['bytes_sent'] / 1e6:.2f} MB | wait {metrics['wait_s']:.2f} s"
        + (f" | {ranks} local ranks" if (ranks := metrics.get("local_world_size", 1)) > 1 else "")
        + ("" if metrics["averaged"] else " | averaging failed")
        + ("" if metrics["in_sync"] else " | OUT OF SYNC")
    )


class ProgressDisplay:
    """The peer's progress output (see the module docstring); safe to call from one thread."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        min_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        columns: Callable[[], int] | None = None,
        credit: Callable[[], Credit | None] = lambda: None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.live = _is_terminal(self.stream)
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.columns = columns or (lambda: shutil.get_terminal_size((100, 24)).columns)
        self.credit = credit
        """Where the coordinator's latest word on this peer's credit comes from (None: no coordinator)."""
        self.last_group: int | None = None
        self.sent_total = 0
        self._drawn_at = -float("inf")
        self._showing = False

    def inner_step(self, progress: InnerProgress) -> None:
        now = self.clock()
        finished = progress.steps is not None and progress.step >= progress.steps
        if not self.live or (now - self._drawn_at < self.min_interval_s and not finished):
            return
        self._drawn_at = now
        filled = round(progress.fraction * BAR_WIDTH)
        if progress.steps:
            where = f"{progress.step}/{progress.steps} steps"
        else:
            where = f"{progress.elapsed_s:.0f}/{progress.budget_s:.0f} s, {progress.step} steps"
        rate = progress.samples / max(progress.elapsed_s, 1e-9)
        self._draw(
            f"round {progress.round:>4} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {where} | "
            f"loss {progress.loss:.4f} | {rate:.1f} samples/s | {self._swarm_part()}"
        )

    def waiting(self, round_: int) -> None:
        if self.live:
            self._draw(f"round {round_:>4} averaging: looking for a group, then all-reduce | {self._swarm_part()}")

    def joining(self, text: str) -> None:
        """A line of its own: a join's or re-sync's steps are few and each may take minutes."""
        self.say(f"catching up: {text}")

    def round_done(self, metrics: dict[str, Any]) -> None:
        """Leave the round's permanent line (replacing the live one on a terminal)."""
        self.last_group = int(metrics["group_size"]) if metrics["averaged"] else self.last_group
        self.sent_total += int(metrics["bytes_sent"])
        self.clear()
        self.stream.write(round_line(metrics) + "\n")
        self.stream.flush()

    def say(self, line: str) -> None:
        """A permanent line of its own (the live line, if shown, is redrawn by the next update)."""
        self.clear()
        self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Remove the live line so that other output starts at the line's beginning."""
        if self._showing:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self._showing = False

    def guard_logging(self) -> None:
        """Clear the live line before this process's log records reach the same terminal."""
        if not self.live:
            return
        for handler in logging.getLogger().handlers:
            stream = getattr(handler, "stream", None)
            if stream is not None and _is_terminal(stream):
                handler.addFilter(self._clear_for_record)

    def _clear_for_record(self, record: logging.LogRecord) -> bool:
        self.clear()
        return True

    def _swarm_part(self) -> str:
        group = "no group yet" if self.last_group is None else f"last group {self.last_group}"
        text = f"{group} | sent {self.sent_total / 1e6:.2f} MB"
        credit = self.credit()
        if credit is not None:
            text += f" | credited {credit.samples:,} samples" + (
                f" (+{credit.pending_samples:,} pending)" if credit.pending_samples else ""
            )
        return text

    def _draw(self, text: str) -> None:
        width = max(self.columns() - 1, 20)
        self.stream.write(CLEAR_LINE + text[:width])
        self.stream.flush()
        self._showing = True


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
