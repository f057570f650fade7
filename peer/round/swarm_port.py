"""What the trainer needs from the swarm: the small typed interface ``peer.swarm.swarm.Swarm``
implements (and the unit tests' in-memory swarm), so that the training loop never reaches
into hivemind's DHT or averager."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.outcome import AllReduceStats, FragmentDone
from protocol.agreement import Agreement, agreed_state
from protocol.gathered import Gathered, votes
from protocol.identity import Identity, PublicKey
from protocol.roster import RosterClaim
from protocol.updates import FetchedUpdate

StateTaker = Callable[[int, torch.Tensor, torch.Tensor, str], dict[str, Any]]
StateProvider = Callable[[StateTaker], dict[str, Any]]
"""Calls its argument with the (round, params, momentum, digest) this peer serves to others (its
tensors read then, not kept) and returns what that returned, or raises if the state changed
meanwhile (``engine.state_transfer.StateProvider``)."""
DownloadedState = tuple[int, torch.Tensor, torch.Tensor]
"""(round, params, momentum) of a state downloaded from a member, digest verified."""


NEGLIGIBLE_WEIGHT = 1e-12
"""The weight of a peer that contributes nothing (its pseudo-gradient was refused, or it has
no samples): it still takes part, so that it receives the average, but its zeros do not move
the result measurably."""


@dataclass
class RoundResult:
    """What a completed averaging round gives the trainer: the engine's record of this peer's
    all-reduce (``stats``, ``engine.outcome.AllReduceStats``) carried as it is, with what only the
    peer can say beside it (the members by their public ids, how long it waited)."""

    averaged: torch.Tensor
    """The group's average: the averager's shared vector itself (no copy), valid until this
    peer writes its next round into it."""
    group_size: int
    members: list[Gathered]
    """What each member of the group stated (``protocol.gathered``; members whose statement was
    unreadable are left out)."""
    stats: AllReduceStats
    """Bytes, the all-reduce's seconds, the ranges that hold no average (``missing``: a reducer
    failed, or all of it when this peer's own all-reduce failed; this peer does not land such
    a round, ``peer.round.verdict``) or that the audits left out (``left_out``: the round lands
    without them), the audits' cost. Keyed by libp2p id where it names peers."""
    wait_s: float
    round_s: float = 0.0
    """Launch to result: matchmaking (incl. waiting for slower peers) plus all-reduce."""
    offenders: dict[str, str] = field(default_factory=dict)
    """Members (public id) whose contribution this peer's reducer bounded or refused, or whose
    reducer failed this peer, with why (``stats.offences`` by public id)."""
    receipts: dict[str, bytes] = field(default_factory=dict)
    """Members (public id) → the receipt each one's reducer signed for this peer's parts
    (``protocol.receipts``): their word, reported with the round, should they never report."""
    led: dict[str, float] | None = None
    """Set if this peer led the group (``RoundMatchmaking.led``): its size, the leader's
    event-loop CPU seconds to form it, the metadata bytes it sent to start the round."""

    @property
    def matchmaking_s(self) -> float:
        """Launch to group formed: the search, waiting for slower peers included."""
        return max(0.0, self.round_s - self.stats.allreduce_s)

    def unaveraged(self) -> float:
        """Fraction of the vector left out of this round (``missing``)."""
        return sum(hi - lo for lo, hi in self.stats.missing) / max(1, self.averaged.numel())

    def left_out_share(self) -> float:
        """Fraction of the vector this landed round leaves out (``left_out``)."""
        return sum(hi - lo for lo, hi in self.stats.left_out) / max(1, self.averaged.numel())

    def started_in_sync(self, round_: int, digest: str) -> bool:
        """Whether this peer's pre-round state (``round_``, ``digest``) is the group's agreed
        state (``protocol.agreement``, as ``stale_members`` decides). True if no member said;
        False without an agreement, where nobody can tell which state is the swarm's."""
        cast = votes((str(i), data) for i, data in enumerate(self.members))
        if not cast:
            return True
        agreed = agreed_state(cast)
        return agreed is not None and (agreed.round, agreed.digest) == (round_, digest)


class FragmentAnswer(Protocol):
    """The answer to a fragment of a round averaged in turn (``PendingAverage.open_fragment``)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> FragmentDone:
        """Block (up to ``timeout`` s: ``TimeoutError`` past it) for the fragment's outcome."""
        ...


class PendingAverage(Protocol):
    """An averaging round started in the background."""

    meets: int
    """The round whose group it looks for (its own, or a later one an open-run newcomer meets)."""

    def open_fragment(self, index: int) -> FragmentAnswer:
        """Fragments in turn (``averaging.sync_fragments`` > 1): fragment ``index`` of this round
        is in the buffer (``SwarmPort.fragment_buffer``); average it with the group. The buffer
        is the averager's until the answer is done."""
        ...

    def done(self) -> bool: ...

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the round to end: whether ``result`` would return at once
        (True where that cannot be told: ``result`` then blocks)."""
        ...

    def result(self) -> RoundResult | None:
        """Block until the round ends: its result, or None if it failed."""
        ...

    def abandon(self) -> bool:
        """Give up the round if it is still looking for its group (a group that formed goes on):
        whether it did (``result`` is then None)."""
        ...


@dataclass(frozen=True)
class LentOutbox:
    """The outbox's vector, held for the borrower until ``release`` (``SwarmPort.lend_outbox``)."""

    vector: torch.Tensor
    release: Callable[[], None]
    """Give it back (once; later calls do nothing). A round started meanwhile waits for it."""


class SwarmPort(Protocol):
    def outbox(self) -> AbstractContextManager[torch.Tensor]:
        """The flat float32 vector the next round averages, to write this peer's (compensated)
        pseudo-gradient into in place; after a successful round it holds the group's average
        (``RoundResult.averaged`` is this vector, valid until the next write)."""
        ...

    def lend_outbox(self) -> LentOutbox | None:
        """The outbox's vector for the caller's own use until it releases it (the inner steps'
        gradients: ``peer.round.grad_home``): nothing averages it meanwhile, and what the
        caller leaves in it is garbage to the next round (which writes its vector whole).
        None, at once, while a round averages it. The caller must release it before it asks for
        ``outbox`` or a round's result."""
        ...

    def fragment_buffer(self) -> torch.Tensor:
        """Fragments in turn: the buffer a round's fragments are written to and averaged in, one
        at a time (as long as the longest fragment), the caller's from a fragment's answer to
        the next ``open_fragment``."""
        ...

    def set_sync_span(self, span_s: float) -> None:
        """Fragments in turn: how far apart members may open a fragment (about an inner phase)."""
        ...

    def start_round(
        self,
        *,
        weight: float,
        gather: Gathered,
        timeout: float | None = None,
        window: float | None = None,
        joining: bool = False,
    ) -> PendingAverage:
        """Average the outbox's vector with whoever is looking within ``timeout`` s; this peer
        declares it would lead a group for ``window`` s (default ``matchmaking_window(timeout)``).
        ``joining``: a newcomer's search for the round in progress (it waits longer for a
        leader's answer: ``peer.swarm.swarm.JOINING_REQUEST_FACTOR``)."""
        ...

    def set_allreduce_timeout(self, timeout_s: float) -> None: ...

    def saw_group(self, members: list[Gathered]) -> None: ...

    def publish_digest(
        self,
        identity: Identity,
        *,
        round_: int,
        digest: str,
        roster: int = 0,
        leaving: bool = False,
        landed: float | None = None,
    ) -> None: ...

    def roster_of(self, digest: str, *, exclude: PublicKey | None = None) -> RosterClaim: ...

    def lookup_s(self) -> float:
        """How long a DHT lookup takes from this peer lately (a declaration takes about as long
        to be seen)."""
        ...

    def prefetch_records(self) -> None:
        """Begin reading the digest records in the background: the next read of them takes this
        one (a lookup beside an update download: one lookup's time for both)."""
        ...

    def behind(self, round_: int) -> bool: ...

    def accepted_state(self, *, exclude: PublicKey | None = None) -> Agreement | None: ...

    def fallback_states(self, *, exclude: PublicKey | None = None, after_round: int = -1) -> list[Agreement]: ...

    def landed_beside(self, round_: int, group: frozenset[str], *, within_s: float) -> frozenset[str]:
        """Who, outside ``group`` (public ids) and with a vote that counts, landed a round after
        ``round_`` by averaging in the last ``within_s`` s: another group landed this round."""
        ...

    def peers_at(self, round_: int, *, exclude: PublicKey | None = None) -> set[str]: ...

    def seen_at(self, round_: int) -> float | None:
        """When (monotonic) this peer first saw a digest record of ``round_``; None if it has not."""
        ...

    def serve_state(self, provider: StateProvider) -> None: ...

    def download_state(
        self, accept: set[str], *, timeout: float, newer_than: int | None = None
    ) -> DownloadedState | None:
        """A state whose digest is in ``accept`` from a member that serves it, or, with
        ``newer_than``, one of a later round (the swarm moved on since the caller read the
        records: the caller checks its digest against them before adopting it)."""
        ...

    def keep_update(self, round_: int, pre: str, post: str, left_out: list[tuple[int, int]]) -> None:
        """Round ``round_`` landed here from state ``pre`` to ``post``: keep the averaged update
        the swarm's last round gave this peer, for newcomers to roll forward by."""
        ...

    def download_update(self, round_: int, digest: str, *, timeout: float) -> FetchedUpdate | None:
        """The averaged update that takes the state of ``round_`` (``digest``) one round forward,
        from a member that kept it; None if no member did."""
        ...
