"""What a member states to its group as a round starts: the one record every member of an
averaging group gathers from every other (hivemind's ``data_for_gather``), typed.

On the wire it is a msgpack map (``to_wire``): ``id``, ``round``, ``digest``, ``samples``,
``roster``, ``known`` and, where the round meets under another round's key, ``meet``. Another
member's bytes are untrusted input, so ``Gathered.parse`` reads each field on its own and keeps
what is well-formed: a member whose map lacks a valid ``round`` or ``digest`` still counts as a
member but casts no vote (``vote``), a malformed roster claim is no claim (0), an id that is no
string is no id. Everything downstream (the agreement and roster rules, the averager's stale
members, the round's result and the report to the coordinator) reads this record, never the map.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol.agreement import Agreement, Vote, agreed_state

__all__ = ["MAX_ROSTER", "MAX_ROUND", "Gathered", "group_agreement", "votes"]

MAX_ROSTER = 1 << 20
"""The largest roster a member may claim (claims above it are ignored as malformed)."""
MAX_ROUND = 1 << 62
"""Rounds at or above this are malformed (a member's round is a count of rounds)."""
MAX_ID_CHARS = 200
"""Longer ids are no ids (a public id is ~50 characters)."""


def _round(value: object) -> int | None:
    return value if type(value) is int and 0 <= value < MAX_ROUND else None


@dataclass(frozen=True)
class Gathered:
    """One member's statement at the start of a round."""

    id: str = ""
    """Its public id (``protocol.identity``); empty when it stated none that is well-formed."""
    round: int | None = None
    """The round of the state it starts from (None: it stated none)."""
    digest: str | None = None
    """The digest of that state (None: it stated none)."""
    samples: float = 0.0
    """The samples it claims for the round, as it stated them (its say-so: bounded where a
    report carries it, ``peer.link.coordinator_client.reported_weight``)."""
    roster: int = 0
    """The roster size of its pre-round state as it knows it (0: unknown; ``protocol.roster``)."""
    known: bool = False
    """Whether it is itself in that roster."""
    meet: int | None = None
    """The round whose DHT key the round meets under, where not its own (``peer.swarm.swarm``)."""
    link: float | None = None
    """Bytes a second its link carries, as it measured it (its last state download; None:
    unmeasured): the group stretches the round's
    deadlines to it (``engine.link_timeouts``), within bounds, so that a member on a slow link
    is not cut off mid-part."""

    def vote(self, voter: str) -> Vote | None:
        """Its vote as ``voter`` ("after round ``round`` I hold ``digest``"), if it stated both."""
        if self.round is None or self.digest is None:
            return None
        return Vote(voter, self.round, self.digest)

    def holds(self, round_: int, digest: str) -> bool:
        """Whether it starts from the state ``(round_, digest)``."""
        return self.round == round_ and self.digest == digest

    def to_wire(self) -> dict[str, object]:
        """The msgpack map a member gathers."""
        wire: dict[str, object] = {
            "id": self.id,
            "round": self.round,
            "samples": self.samples,
            "digest": self.digest,
            "roster": self.roster,
            "known": self.known,
        }
        if self.meet is not None:
            wire["meet"] = self.meet
        if self.link is not None:
            wire["link"] = self.link
        return wire

    @classmethod
    def parse(cls, data: object) -> Gathered | None:
        """A member's gathered map, field by field (see the module doc); None if it is no map."""
        if not isinstance(data, dict):
            return None
        key, digest, roster = data.get("id"), data.get("digest"), data.get("roster")
        samples = data.get("samples", 0)
        return cls(
            id=key if isinstance(key, str) and len(key) < MAX_ID_CHARS else "",
            round=_round(data.get("round")),
            digest=digest if isinstance(digest, str) else None,
            samples=_number(samples),
            roster=roster if type(roster) is int and 0 < roster <= MAX_ROSTER else 0,
            known=data.get("known") is True,
            meet=_round(data.get("meet")),
            link=_link(data.get("link")),
        )


MIN_LINK, MAX_LINK = 1e3, 1e12
"""A stated link outside these bytes a second is no statement (how long a slow statement makes a
group wait is capped besides: ``engine.link_timeouts``)."""


def _link(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if MIN_LINK <= value <= MAX_LINK else None


def _number(value: object) -> float:
    """A stated number as it was stated (an int stays one), NaN where it is none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return value


def votes(members: Iterable[tuple[str, Gathered | None]]) -> list[Vote]:
    """The votes of an averaging group's members, each under the name it is given: members that
    gathered no map, or no ``round`` and ``digest``, cast none."""
    cast = []
    for voter, data in members:
        vote = data.vote(voter) if data is not None else None
        if vote is not None:
            cast.append(vote)
    return cast


def group_agreement(members: Sequence[Gathered]) -> Agreement | None:
    """The state a group's members agree on (``protocol.agreement``: the strict majority of the
    newest round stated); None if they stated none or tie."""
    return agreed_state(votes((str(i), data) for i, data in enumerate(members)))
