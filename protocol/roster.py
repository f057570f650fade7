"""The round's roster: which group is *the* round's group, so one state lands per round.

hivemind's matchmaking can form two groups in one round (a peer that launches after the
leader closed leads a group of its own; a leader killed mid-matchmaking scatters its
followers), and each group would land a different state. A round's state is the swarm's only
if its group holds a strict majority of the round's **roster**: the members that were in
sync in the group that produced the state the round starts from (they all landed it, from
the same gathered metadata, so they all count the same number). Two disjoint groups cannot
both hold more than half of one roster, so at most one of them lands; the others keep
their work (it folds into their next round's pseudo-gradient, as for any failed round) and
re-sync to the state that did land.

Each member gathers, beside its round and digest (``protocol.agreement``):
- ``roster``: the roster size of its pre-round state, as it knows it (it landed that state
  in a group: the in-sync members of that group; it adopted it by download: the size the
  state's holders published with their digest records; 0 when nobody knows, e.g. the
  initial state);
- ``known``: whether it was itself a member of that roster (it landed the state by averaging).

The group's verdict (``verdict``) is computed by every member from the same gathered
metadata, so all members of a group reach the same one: it lands when more than half of the
roster (its ``known`` members at the state) are in it. Newcomers and re-synced peers hold the
state but do not count (else a group of them could pass beside the roster's own), but for one:
a member of the group that produced the state, which a reducer failed (it could not land the
round itself and took the state by download), is in that roster by the definition above and
counts again once more than half of the roster, by name, publish that they hold the state it
took (``peer.round.roster_book.RosterBook.adopted``): else the next round's leader, missing it, would
wait out its window. A swarm
where more than half of the roster left at once would never pass again, so a member that
failed the rule ``ROSTER_RELEASE_AFTER`` times in a row at the same state gathers ``roster``
0 (it claims no size) but stays ``known`` (it is still one of the roster: where another holder
still claims the size, it counts toward that majority, and two disjoint groups still cannot
both hold more than half of one roster); a group where nobody claims a roster needs only
``min_group_size`` holders
(the initial state, or after a release: the one case two groups could both land). Such a
group, before it lands, looks at the digest records (``landed_beside``): if a peer whose vote
counts, outside the group, says it landed a later round by averaging within the last
``fence_s``, another group landed this round first, and this one does not land (its members
re-sync to that state and keep their work). Two groups that land within one record's trip
through the DHT of each other can still both land; a group that forms later (the soak's second
group of two came 28 s after the first) cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from protocol.agreement import agreed_state
from protocol.gathered import MAX_ROSTER, Gathered, votes
from protocol.statesync import DigestRecord

__all__ = [
    "MAX_ROSTER",
    "ROSTER_RELEASE_AFTER",
    "RosterClaim",
    "Verdict",
    "in_sync_count",
    "in_sync_ids",
    "landed_beside",
    "leader_may_close",
    "leavers",
    "produced_state",
    "verdict",
]

ROSTER_RELEASE_AFTER = 2
"""Consecutive rounds failed by the roster rule, at the same state, after which a member stops
claiming a roster (so a swarm that lost more than half of its roster at once moves on)."""


@dataclass(frozen=True)
class Verdict:
    """Whether a group's round is the round's one state (``lands``), and why."""

    lands: bool
    holders: int
    """Members of the group that start from the group's agreed state."""
    roster: int
    """The roster size the group's holders claim (0: nobody claims one)."""
    reason: str


@dataclass(frozen=True)
class RosterClaim:
    """What the eligible holders of a state published about it: its roster size (0: nobody
    claims one) and who they are (public ids)."""

    size: int
    holders: frozenset[str]


def _claims(members: Sequence[Gathered], round_: int, digest: str) -> tuple[int, list[int], int]:
    """(holders of ``(round_, digest)``, their roster claims > 0, how many of them are known)."""
    holders = [data for data in members if data.holds(round_, digest)]
    claims = [data.roster for data in holders if data.roster > 0]
    return len(holders), claims, sum(1 for data in holders if data.known)


def claimed_roster(claims: Iterable[int]) -> int:
    """The roster the holders claim: the most common claim (a tie: the larger), 0 if none.
    Honest holders of one state all claim the same number; one liar moves nothing unless the
    liars are the most common claim."""
    counts: dict[int, int] = {}
    for claim in claims:
        counts[claim] = counts.get(claim, 0) + 1
    if not counts:
        return 0
    return max(counts.items(), key=lambda item: (item[1], item[0]))[0]


def _agreed(members: Sequence[Gathered]) -> tuple[bool, tuple[int, str] | None]:
    """(whether any member stated a state, the state the members agree on)."""
    cast = votes((str(i), data) for i, data in enumerate(members))
    agreed = agreed_state(cast)
    return bool(cast), (agreed.round, agreed.digest) if agreed is not None else None


def verdict(members: Sequence[Gathered], *, min_group_size: int) -> Verdict:
    """The rule above for a group whose members gathered ``members`` (one entry each)."""
    stated, agreed = _agreed(members)
    if not stated:  # an honest member always states its own: a group of none is nobody's concern
        return Verdict(True, 0, 0, "no member states its state")
    if agreed is None:
        return Verdict(False, 0, 0, "the group's members agree on no state")
    holders, claims, known = _claims(members, *agreed)
    roster = claimed_roster(claims)
    if roster == 0:
        lands = holders >= min_group_size
        why = f"{holders} members hold its state, no roster claimed (at least {min_group_size} needed)"
        return Verdict(lands, holders, 0, why)
    lands = 2 * known > roster
    why = f"{known} of its roster of {roster} are in ({holders} members hold its state; more than half needed)"
    return Verdict(lands, holders, roster, why)


def _in_sync(members: Sequence[Gathered]) -> list[Gathered]:
    """The members of a group that started from its agreed state."""
    _stated, agreed = _agreed(members)
    return [data for data in members if data.holds(*agreed)] if agreed is not None else []


def in_sync_count(members: Sequence[Gathered]) -> int:
    """How many members of a group started from its agreed state: the roster of the state the
    group lands (every member that lands it computes the same number)."""
    return len(_in_sync(members))


def in_sync_ids(members: Sequence[Gathered]) -> frozenset[str]:
    """The ids of a group's members that started from its agreed state: the roster of the
    state the group lands, by name."""
    return frozenset(data.id for data in _in_sync(members) if data.id)


def produced_state(members: Sequence[Gathered]) -> tuple[int, frozenset[str]] | None:
    """The round of the state a group of ``members`` makes if it lands (its agreed state's,
    plus one) and that state's roster by name (``in_sync_ids``); None without an agreed state."""
    _stated, agreed = _agreed(members)
    if agreed is None:
        return None
    return agreed[0] + 1, in_sync_ids(members)


def leader_may_close(members: Sequence[Gathered], left: Iterable[str] = ()) -> bool:
    """Whether a leader whose group has gathered ``members`` may start the all-reduce before
    its window ends: every member of the roster of the group's state is in (the roster's
    ``known`` members, as many as the roster claims) or has left it (``left``: public ids of
    roster members that said they stopped cleanly holding the group's state, ``leavers``).
    Without a claimed roster this rule does not close (the first round, or after a roster
    release); a leader that saw the state made closes by its roster's names instead
    (``engine.matchmaking.RoundMatchmaking._may_close``). A leave only ends the wait: ``verdict`` still needs more than half of the
    whole roster in the group, so a "leaver" that lies lowers no majority."""
    _stated, agreed = _agreed(members)
    if agreed is None:
        return False
    _holders, claims, known = _claims(members, *agreed)
    roster = claimed_roster(claims)
    present = {data.id for data in members if data.id}
    gone = len(set(left) - present)
    return roster > 0 and known + gone >= roster


def leavers(members: Sequence[Gathered], roster_ids: Iterable[str], records: Iterable[DigestRecord]) -> frozenset[str]:
    """The public ids of the roster that said they left holding the state ``members`` agree on:
    a signed ``leaving`` digest record of that state (``protocol.statesync``) from an id in
    ``roster_ids`` (the members of the group that made the state, as this leader saw them:
    nobody else's leave counts), not in the group."""
    _stated, agreed = _agreed(members)
    if agreed is None:
        return frozenset()
    roster = set(roster_ids)
    present = {data.id for data in members if data.id}
    return frozenset(
        record.signer.id
        for record in records
        if record.leaving
        and (record.round, record.digest) == agreed
        and record.signer.id in roster
        and record.signer.id not in present
    )


def landed_beside(
    records: Iterable[DigestRecord],
    *,
    round_: int,
    group: Iterable[str],
    eligible: Callable[[str], bool],
    since: float,
) -> frozenset[str]:
    """The public ids, outside ``group`` and whose votes count (``eligible``), whose digest
    records say they landed by averaging (``landed``, DHT time) after ``since`` a state of a
    round after ``round_``: evidence that a group beside the one of ``group`` landed round
    ``round_ + 1``. Adopters (no landing time) and archives say nothing, nor do records older
    than ``since`` (a dead peer's record of a timeline the swarm rolled back from lingers until
    it expires)."""
    members = set(group)
    return frozenset(
        record.signer.id
        for record in records
        if record.round > round_
        and record.landed is not None
        and record.landed > since
        and not record.archive
        and record.signer.id not in members
        and eligible(record.signer.id)
    )
