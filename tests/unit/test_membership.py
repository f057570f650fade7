"""MemberGate: which libp2p peer ids hold a valid token of this run's coordinator."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from protocol.errors import SwarmtrainError
from protocol.identity import Identity
from protocol.membership import Lookup, MemberGate, make_revocations, parse_revocations
from protocol.tokens import issue_token

RUN = "a" * 64
COORDINATOR = Identity.generate()


def token(
    peer_id: str,
    *,
    coordinator: Identity = COORDINATOR,
    run: str = RUN,
    ttl_s: float = 600.0,
    now: float | None = None,
    peer: Identity | None = None,
) -> bytes:
    issued = time.time() if now is None else now
    peer_key = (peer or Identity.generate()).public_key
    return issue_token(
        coordinator, run_digest=run, peer_key=peer_key, now=issued, ttl_s=ttl_s, libp2p_peer_id=peer_id
    ).to_bytes()


def members(records: dict[Any, Any]) -> Lookup:
    return Lookup(records, None)


def gate(**kwargs: Any) -> MemberGate:
    return MemberGate(coordinator_key=COORDINATOR.public_key, run_digest=RUN, prefix="run", **kwargs)


def test_valid_tokens_admit_the_peer_ids_they_are_filed_under() -> None:
    g = gate()
    g.update(members({"QmA": token("QmA"), "QmB": token("QmB")}), now=time.time())
    assert g.is_member("QmA", now=time.time()) and g.is_member("QmB", now=time.time())
    assert not g.is_member("QmC", now=time.time())


def test_bad_records_admit_nobody() -> None:
    now = time.time()
    g = gate()
    g.update(
        members(
            {
                "QmStolen": token("QmOwner"),  # someone else's token filed under another peer id
                "QmForged": token("QmForged", coordinator=Identity.generate()),
                "QmOtherRun": token("QmOtherRun", run="b" * 64),
                "QmExpired": token("QmExpired", ttl_s=60.0, now=now - 120.0),
                "QmJunk": b"\x00not a token",
                "QmText": "not bytes",
                7: token("7"),
            }
        ),
        now=now,
    )
    for peer_id in ("QmStolen", "QmOwner", "QmForged", "QmOtherRun", "QmExpired", "QmJunk", "QmText", "7"):
        assert not g.is_member(peer_id, now=now), peer_id


def test_membership_ends_when_the_token_expires() -> None:
    now = time.time()
    g = gate()
    g.update(members({"QmA": token("QmA", ttl_s=60.0, now=now)}), now=now)
    assert g.is_member("QmA", now=now + 59.0)
    assert not g.is_member("QmA", now=now + 60.0)


def test_an_unknown_peer_triggers_a_lookup_at_most_once_per_interval() -> None:
    records: dict[Any, Any] = {}
    lookups = []

    async def fetch() -> Lookup:
        lookups.append(1)
        return members(dict(records))

    async def scenario() -> list[bool]:
        g = gate(refresh_interval_s=3600.0)
        first = await g.admitted("QmA", fetch)  # looks up: nobody yet
        records["QmA"] = token("QmA")
        second = await g.admitted("QmA", fetch)  # within the interval: no new lookup
        g.refresh_interval_s = 0.0
        third = await g.admitted("QmA", fetch)  # looks up again and finds it
        fourth = await g.admitted("QmA", fetch)  # known: no lookup
        return [first, second, third, fourth]

    assert asyncio.run(scenario()) == [False, False, True, True]
    assert len(lookups) == 2


def test_a_newcomer_first_seen_within_the_interval_is_looked_up_at_once() -> None:
    """A token stored just after another peer's lookup must not turn its peer away for the
    rest of the interval (a round's window): its first request looks again."""
    records: dict[Any, Any] = {}
    lookups = []

    async def fetch() -> Lookup:
        lookups.append(1)
        return members(dict(records))

    async def scenario() -> list[bool]:
        g = gate(refresh_interval_s=3600.0)
        other = await g.admitted("QmA", fetch)  # looks up: nobody yet
        records["QmB"] = token("QmB")
        newcomer = await g.admitted("QmB", fetch)  # first sighting: looks again, finds it
        again = await g.admitted("QmA", fetch)  # QmA was looked up for: the interval holds
        return [other, newcomer, again]

    assert asyncio.run(scenario()) == [False, True, False]
    assert len(lookups) == 2


def test_a_failed_lookup_admits_nobody_new() -> None:
    async def fetch() -> Lookup:
        return Lookup(None, None)

    assert asyncio.run(gate().admitted("QmA", fetch)) is False


def test_a_lookup_that_raises_keeps_the_known_members() -> None:
    g = gate(refresh_interval_s=0.0)
    g.update(members({"QmA": token("QmA")}), now=time.time())

    async def fetch() -> Lookup:
        raise TimeoutError("dht unreachable")

    assert asyncio.run(g.admitted("QmB", fetch)) is False
    assert g.is_member("QmA", now=time.time())


def test_a_revoked_peer_stops_counting_and_an_older_list_does_not_bring_it_back() -> None:
    now = time.time()
    banned, honest = Identity.generate(), Identity.generate()
    g = gate()
    g.update(members({"QmBad": token("QmBad", peer=banned), "QmGood": token("QmGood", peer=honest)}), now=now)
    assert g.is_member("QmBad", now=now)
    older = make_revocations(COORDINATOR, set(), now=now - 10)
    newer = make_revocations(COORDINATOR, {banned.public_key.id}, now=now - 5)
    g.update(Lookup(None, {"c": newer}), now=now)
    assert not g.is_member("QmBad", now=now) and g.is_member("QmGood", now=now)
    g.update(Lookup(None, {"c": older}), now=now)  # a stale copy re-stored by someone
    assert not g.is_member("QmBad", now=now)
    lifted = make_revocations(COORDINATOR, set(), now=now)
    g.update(Lookup(None, {"c": lifted}), now=now)
    assert g.is_member("QmBad", now=now)


def test_revocation_lists_not_from_the_coordinator_are_ignored() -> None:
    now = time.time()
    honest = Identity.generate()
    g = gate()
    g.update(members({"QmGood": token("QmGood", peer=honest)}), now=now)
    forged = make_revocations(Identity.generate(), {honest.public_key.id}, now=now)
    g.update(Lookup(None, {"x": forged, "y": b"junk", "z": "text"}), now=now)
    assert g.is_member("QmGood", now=now)
    with pytest.raises(SwarmtrainError, match="not by this run's coordinator"):
        parse_revocations(forged, coordinator_key=COORDINATOR.public_key, now=now)


def test_known_members_are_rechecked_so_a_revocation_takes_effect() -> None:
    banned = Identity.generate()
    records = {"QmBad": token("QmBad", peer=banned)}
    revocations: dict[Any, Any] = {}

    async def fetch() -> Lookup:
        return Lookup(dict(records), dict(revocations))

    async def scenario() -> list[bool]:
        g = gate(refresh_interval_s=0.0, recheck_s=3600.0)
        first = await g.admitted("QmBad", fetch)
        revocations["c"] = make_revocations(COORDINATOR, {banned.public_key.id}, now=time.time())
        cached = await g.admitted("QmBad", fetch)  # known, recheck not due
        g.recheck_s = 0.0
        rechecked = await g.admitted("QmBad", fetch)
        return [first, cached, rechecked]

    assert asyncio.run(scenario()) == [True, True, False]


def test_a_stale_ok_admission_answers_at_once_and_renews_behind_it() -> None:
    """A newcomer asking members for updates right after a state download (the recheck due: a
    lookup, a second on a home link) asks at once; the lookup runs behind it, and a revocation
    it finds takes effect for the next ask. An unknown peer is never admitted without one."""
    banned = Identity.generate()
    records = {"QmBad": token("QmBad", peer=banned)}
    revocations: dict[Any, Any] = {}
    lookups: list[asyncio.Event] = []

    async def fetch() -> Lookup:
        done = asyncio.Event()
        lookups.append(done)
        await asyncio.sleep(0.05)
        done.set()
        return Lookup(dict(records), dict(revocations))

    async def scenario() -> list[object]:
        g = gate(refresh_interval_s=0.0, recheck_s=0.0)
        first = await g.admitted("QmBad", fetch)
        revocations["c"] = make_revocations(COORDINATOR, {banned.public_key.id}, now=time.time())
        at_once = await g.admitted("QmBad", fetch, stale_ok=True)
        await asyncio.sleep(0)  # the lookup it started runs: not finished yet
        behind = len(lookups) == 2 and not lookups[-1].is_set()
        again = await g.admitted("QmBad", fetch, stale_ok=True)  # one renewal at a time
        once = len(lookups) == 2
        await asyncio.sleep(0.2)
        after = await g.admitted("QmBad", fetch, stale_ok=True)
        stranger = await g.admitted("QmNobody", fetch, stale_ok=True)
        return [first, at_once, behind, again, once, after, stranger]

    assert asyncio.run(scenario()) == [True, True, True, True, True, False, False]


def test_a_refresh_within_its_max_age_reads_nothing() -> None:
    """Every read of the digest records asks who is a member: two DHT lookups each, a second on
    a home link, unless the last lookup is fresh enough."""

    class Found:
        def result(self) -> None:
            return None

    class CountingDHT:
        gets = 0

        def get(self, key: Any, latest: bool = False, return_future: bool = False) -> Found:
            assert return_future  # both keys are asked at once
            self.gets += 1
            return Found()

    g, dht = gate(), CountingDHT()
    g.refresh(dht, max_age_s=1.0)
    g.refresh(dht, max_age_s=1.0)
    assert dht.gets == 2  # the first refresh only
    g.refresh(dht)
    assert dht.gets == 4  # no max age: now


def test_a_refresh_asks_for_both_keys_before_it_waits_for_either() -> None:
    """The members and the revocations are looked up at once: one lookup's time (a second on a
    home link), not two."""
    asked: list[str] = []

    class Found:
        def result(self) -> None:
            asked.append("waited")

    class DHT:
        def get(self, key: Any, latest: bool = False, return_future: bool = False) -> Found:
            asked.append("asked")
            return Found()

    finish = gate().start_refresh(DHT())
    assert finish is not None and asked == ["asked", "asked"]
    finish()
    assert asked == ["asked", "asked", "waited", "waited"]
