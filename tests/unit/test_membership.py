"""MemberGate: which libp2p peer ids hold a valid token of this run's coordinator."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from protocol.identity import Identity
from protocol.membership import MemberGate, members_key
from protocol.tokens import issue_token

RUN = "a" * 64
COORDINATOR = Identity.generate()


def token(peer_id: str, *, coordinator: Identity = COORDINATOR, run: str = RUN, ttl_s: float = 600.0,
          now: float | None = None) -> bytes:
    issued = time.time() if now is None else now
    return issue_token(coordinator, run_digest=run, peer_key=Identity.generate().public_key, now=issued,
                       ttl_s=ttl_s, libp2p_peer_id=peer_id).to_bytes()


def gate(**kwargs: Any) -> MemberGate:
    return MemberGate(coordinator_key=COORDINATOR.public_key, run_digest=RUN, key=members_key("run"), **kwargs)


def test_valid_tokens_admit_the_peer_ids_they_are_filed_under() -> None:
    g = gate()
    g.update({"QmA": token("QmA"), "QmB": token("QmB")}, now=time.time())
    assert g.is_member("QmA", now=time.time()) and g.is_member("QmB", now=time.time())
    assert not g.is_member("QmC", now=time.time())


def test_bad_records_admit_nobody() -> None:
    now = time.time()
    g = gate()
    g.update({
        "QmStolen": token("QmOwner"),  # someone else's token filed under another peer id
        "QmForged": token("QmForged", coordinator=Identity.generate()),
        "QmOtherRun": token("QmOtherRun", run="b" * 64),
        "QmExpired": token("QmExpired", ttl_s=60.0, now=now - 120.0),
        "QmJunk": b"\x00not a token",
        "QmText": "not bytes",
        7: token("7"),
    }, now=now)
    for peer_id in ("QmStolen", "QmOwner", "QmForged", "QmOtherRun", "QmExpired", "QmJunk", "QmText", "7"):
        assert not g.is_member(peer_id, now=now), peer_id


def test_membership_ends_when_the_token_expires() -> None:
    now = time.time()
    g = gate()
    g.update({"QmA": token("QmA", ttl_s=60.0, now=now)}, now=now)
    assert g.is_member("QmA", now=now + 59.0)
    assert not g.is_member("QmA", now=now + 60.0)


def test_an_unknown_peer_triggers_a_lookup_at_most_once_per_interval() -> None:
    records: dict[Any, Any] = {}
    lookups = []

    async def fetch() -> dict[Any, Any]:
        lookups.append(1)
        return dict(records)

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


def test_a_failed_lookup_admits_nobody_new() -> None:
    async def fetch() -> None:
        return None

    assert asyncio.run(gate().admitted("QmA", fetch)) is False


def test_a_lookup_that_raises_keeps_the_known_members() -> None:
    g = gate(refresh_interval_s=0.0)
    g.update({"QmA": token("QmA")}, now=time.time())

    async def fetch() -> dict[Any, Any]:
        raise TimeoutError("dht unreachable")

    assert asyncio.run(g.admitted("QmB", fetch)) is False
    assert g.is_member("QmA", now=time.time())
