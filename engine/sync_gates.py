"""The gates of a round averaged fragment by fragment (``averaging.sync_fragments``; docs/design/
round.md, "Fragments in turn"): the host writes fragment ``s`` of its pseudo-gradient into the
averager's buffer and *opens* its gate; the averager process averages that fragment with the
group as soon as the gate is open and *answers* it (a ``FragmentDone``), after which the buffer
is the host's again, to land the fragment and write the next one.

The buffer holds one fragment, not the vector: a peer's averaging memory is a fragment's, and
nothing but the gates orders who touches it (the host never reads or writes it between an open
and its answer; the averager never touches it between an answer and the next open).

Everything here runs in the averager's process, on its event loop; the host reaches it through
the averager's pipe (``engine.fragment_rounds.FragmentRoundsMixin.open_fragment``).
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.utils.mpfuture import MPFuture

from engine.outcome import FragmentDone

__all__ = ["FragmentDone", "SyncGates"]

logger = logging.getLogger(__name__)

KEPT_ROUNDS = 4
"""Rounds whose gates are remembered: a gate opened for an older round is answered at once."""


class SyncGates:
    """Opened gates and their answers, per (round, fragment), in the averager's process."""

    def __init__(self) -> None:
        self._opened: dict[tuple[int, int], asyncio.Event] = {}
        self._answers: dict[tuple[int, int], MPFuture[FragmentDone]] = {}
        self._closed: dict[int, str] = {}
        """Rounds whose all-reduce is over here, with why the rest of their gates go unanswered."""

    def _event(self, key: tuple[int, int]) -> asyncio.Event:
        event = self._opened.get(key)
        if event is None:
            event = self._opened[key] = asyncio.Event()
        return event

    def begin(self, round_: int) -> None:
        """A step of round ``round_`` begins (a failed round's work is sent again at the same
        round): its gates may be opened anew."""
        self._closed.pop(round_, None)

    def open(self, round_: int, index: int, answer: MPFuture[FragmentDone], start: int, end: int) -> None:
        """The host wrote fragment ``index`` of round ``round_``; ``answer`` takes its outcome."""
        key = (round_, index)
        why = self._closed.get(round_)
        if why is None and self._closed and round_ < max(self._closed):
            why = "a later round's all-reduce already ran here"
        if why is not None or key in self._answers:
            answer.set_result(FragmentDone(index, start, end, failed=why or "this gate was opened twice"))
            return
        self._answers[key] = answer
        self._event(key).set()
        self._forget_before(round_ - KEPT_ROUNDS)

    async def wait(self, round_: int, index: int, timeout: float | None) -> bool:
        """Wait for the host to open the gate (at most ``timeout`` s): whether it did."""
        event = self._event((round_, index))
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def answer(self, round_: int, done: FragmentDone) -> None:
        """Tell the host how fragment ``done.index`` of round ``round_`` went (once)."""
        answer = self._answers.pop((round_, done.index), None)
        self._opened.pop((round_, done.index), None)
        if answer is not None and not answer.done():
            answer.set_result(done)

    def close(self, round_: int, why: str, bounds: list[tuple[int, int]]) -> None:
        """Round ``round_``'s all-reduce is over here (or never began): every gate of it that is
        open and unanswered, or opened later, is answered as failed with ``why``."""
        self._closed[round_] = why
        for gate_round, index in list(self._answers):
            if gate_round == round_:
                start, end = bounds[index] if 0 <= index < len(bounds) else (0, 0)
                self.answer(round_, FragmentDone(index, start, end, failed=why))
        for key in [key for key in self._opened if key[0] == round_]:
            self._opened.pop(key, None)
        for old in [old for old in self._closed if old < round_ - KEPT_ROUNDS]:
            self._closed.pop(old, None)

    def _forget_before(self, round_: int) -> None:
        for key in [key for key in self._answers if key[0] < round_]:
            answer = self._answers.pop(key)
            if not answer.done():
                answer.set_result(FragmentDone(key[1], 0, 0, failed="the round is long over"))
        for key in [key for key in self._opened if key[0] < round_]:
            self._opened.pop(key, None)
