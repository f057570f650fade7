"""What a round's fragment runners (``engine.allreduce.ExactAllReduceRunner``, one per fragment
of the vector: ``engine.fragments``) found, pooled into one view of the round for this peer:
each member's offences, the reducers that failed it, their receipts."""

from __future__ import annotations

from collections.abc import Sequence

from engine.allreduce import ExactAllReduceRunner
from engine.robust import Alignment, RobustRule, direction_offence

__all__ = ["failed_reducers", "offences", "receipts"]


def receipts(runners: Sequence[ExactAllReduceRunner]) -> dict[str, bytes]:
    """Each reducer's receipt for this peer's parts (libp2p id → bytes), the first fragment's
    that came: one vouches for the sender's weight as well as any."""
    pooled: dict[str, bytes] = {}
    for runner in runners:
        for peer, receipt in runner.receipts.items():
            pooled.setdefault(str(peer), receipt)
    return pooled


def failed_reducers(runners: Sequence[ExactAllReduceRunner]) -> dict[str, str]:
    """Reducers (libp2p id) that failed this peer in any fragment, with the first reason."""
    failed: dict[str, str] = {}
    for runner in runners:
        for peer, reason in runner.failed_reducers.items():
            failed.setdefault(str(peer), reason)
    return failed


def offences(runners: Sequence[ExactAllReduceRunner], robust: RobustRule) -> dict[str, str]:
    """Members this peer's reducers named this round (peer id: why): for a weight or norm or a
    refused part by any fragment's reducer, for their direction pooled over all."""
    named: dict[str, str] = {}
    pooled: dict[str, Alignment] = {}
    for runner in runners:
        for peer, reason in runner.offences.items():
            named.setdefault(str(peer), reason)
        for peer, seen in runner.alignment.items():
            pooled.setdefault(str(peer), Alignment()).add(seen)
    for peer, seen in pooled.items():
        reason = direction_offence(seen, robust)
        if reason:
            named[peer] = f"{named[peer]}; {reason}" if peer in named else reason
    return named
