"""Where a round averaged fragment by fragment stands (``InFlight.turn``), and what writes its
fragments (``TurnWriter``: ``peer.round.in_turn.FragmentsInTurn``), apart from both so that the
launch (which starts such a round) and the part that lands it need not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peer.round.swarm_port import FragmentAnswer, RoundResult

__all__ = ["InTurn", "TurnWriter"]


@dataclass
class InTurn:
    """Where a round averaged fragment by fragment stands (``InFlight.turn``)."""

    bounds: list[tuple[int, int]]
    launch: torch.Tensor
    """The launch point of the fragment in flight (its first values; as long as the longest)."""
    zeros: bool
    """It sends zeros (no samples, or a model that is not finite): nothing to land but the average."""
    next: int = 0
    """The next fragment to write."""
    answer: FragmentAnswer | None = None
    """The answer of the fragment written and not landed yet."""
    compensated: list[bool] = field(default_factory=list)
    """Per fragment written: whether it sent Δ + the residual (else zeros)."""
    lands: bool | None = None
    """Judged on fragment 0's answer: whether this peer lands the round (None: not yet)."""
    counted: bool = False
    """Its group counted this peer's work (it started from the group's state)."""
    judged: RoundResult | None = None
    """The round as fragment 0's answer shows it (its group), for the verdict."""
    over: str = ""
    """Why no further fragment is written ("" while they are): this peer's all-reduce ended."""
    landed: int = 0
    """Fragments landed on the state."""
    left_out: list[tuple[int, int]] = field(default_factory=list)
    """Ranges the group did not average, left out of the landing."""
    host_s: float = 0.0
    allreduce_s: float = 0.0
    """The fragments' all-reduces, each from its gate's open to its answer (the averager's
    whole round also spans the phase between them)."""

    def complete(self) -> bool:
        """Every fragment written and answered (or none will be any more)."""
        return self.answer is None and (self.next >= len(self.bounds) or bool(self.over))

    def failure(self) -> str:
        return self.over or "no fragment was averaged"


class TurnWriter(Protocol):
    """Begins a launched round's fragments in turn (``peer.round.in_turn.FragmentsInTurn``)."""

    @property
    def fragments(self) -> int:
        """Fragments in turn (1: the whole vector at once)."""
        ...

    def begin(self, *, zeros: bool) -> InTurn:
        """Fragment 0 written into the buffer."""
        ...

    def opened(self, flight: Any) -> None:
        """The round (an ``InFlight``) has started: fragment 0's gate opens."""
        ...
