"""The one rule for "which global state is the swarm's".

Every place that turns several parties' statements about a state digest into a decision uses
this module: a peer choosing which state to download (``statesync``), an averaging group
deciding which members started from a stale state (``averaging.stale_members`` and
``RoundResult.started_with_majority``), the coordinator granting credit (``credits.decide``)
and recording a round (``store.finalize_round``), and the archive deciding which state to
keep (``archiver``).

The rule
--------
1. **Only members vote.** The caller says who is eligible: in a gated run, a peer holding a
   valid, unrevoked token of the run's coordinator (``MemberGate.is_member_key``); in an open
   run, a peer this peer has seen in one of its own averaging groups (``Electorate``); in a
   group or a round report, the group's members. Keys are free to mint, so a count of
   signatures by itself is never evidence. Each voter has one vote: its newest.
2. **The newest round decides.** Votes for older rounds are the states of voters that are
   behind; they never outvote a newer state (a voter that is ahead averaged with others that
   the behind ones did not).
3. **A strict majority of that round's voters.** The swarm's state of round ``r`` is the
   digest that more than half of the eligible voters at round ``r`` hold. A tie (e.g. two
   voters, two digests) is *no* agreement: nobody can tell which side is the swarm's, so the
   callers do the safe thing (download nothing, grant nothing, average nothing) and re-check.

Two-member groups follow from 2 and 3: if one member is a round behind, the other's state
is the group's and the one behind is stale (its pseudo-gradient counts 0); if both are at
the same round with different digests, the group has no agreed state and does not average
(both re-check the swarm's state in the DHT).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Agreement", "Vote", "agreed_state", "agreed_states", "majority"]


@dataclass(frozen=True)
class Vote:
    """One party's statement: "after round ``round`` I hold the state ``digest``"."""

    voter: str
    round: int
    digest: str


@dataclass(frozen=True)
class Agreement:
    """The state ``digest`` of ``round``, held by ``votes`` of the ``voters`` at that round."""

    round: int
    digest: str
    votes: int
    voters: int


def majority(digests: Iterable[str]) -> str | None:
    """The digest held by more than half of ``digests`` (one entry per voter); None on a tie
    or when there is none."""
    counts = Counter(digests)
    total = sum(counts.values())
    if not counts:
        return None
    digest, count = counts.most_common(1)[0]
    return digest if 2 * count > total else None


def _latest_votes(votes: Iterable[Vote], eligible: Callable[[str], bool] | None) -> list[Vote]:
    """Each eligible voter's newest vote (a later vote of the same round replaces an earlier one)."""
    latest: dict[str, Vote] = {}
    for vote in votes:
        if eligible is not None and not eligible(vote.voter):
            continue
        known = latest.get(vote.voter)
        if known is None or vote.round >= known.round:
            latest[vote.voter] = vote
    return list(latest.values())


def agreed_states(votes: Iterable[Vote], *, eligible: Callable[[str], bool] | None = None) -> list[Agreement]:
    """For each round some eligible voter is at, newest first, the state a strict majority
    of that round's voters hold; rounds without one (a tie) are left out. The first entry is
    the swarm's state only if its round is the newest round (see ``agreed_state``); older
    entries are fallbacks (the state of a round nobody serves any more may be archived)."""
    by_round: dict[int, list[str]] = {}
    for vote in _latest_votes(votes, eligible):
        by_round.setdefault(vote.round, []).append(vote.digest)
    agreements = []
    for round_ in sorted(by_round, reverse=True):
        digest = majority(by_round[round_])
        if digest is not None:
            agreements.append(Agreement(round_, digest, by_round[round_].count(digest), len(by_round[round_])))
    return agreements


def agreed_state(votes: Iterable[Vote], *, eligible: Callable[[str], bool] | None = None) -> Agreement | None:
    """The swarm's state by the rule above: the strict-majority digest of the newest round any
    eligible voter is at; None if nobody voted or that round is a tie."""
    latest = _latest_votes(votes, eligible)
    if not latest:
        return None
    newest = max(vote.round for vote in latest)
    states = agreed_states(latest)
    return states[0] if states and states[0].round == newest else None
