"""The roster rule: at most one group's state lands per round (``protocol.roster``)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from engine.matchmaking import gathered_metadata
from peer.round.roster_book import RosterBook
from protocol.gathered import Gathered
from protocol.roster import (
    ROSTER_RELEASE_AFTER,
    RosterClaim,
    claimed_roster,
    in_sync_count,
    in_sync_ids,
    landed_beside,
    leader_may_close,
    verdict,
)

D, E = "blake3:" + "d" * 64, "blake3:" + "e" * 64
DECLARED = time.time() + 3600.0
"""When the matchmaking of ``_matchmaking`` declared it would start (DHT time: the wall clock)."""


def member_map(roster: int, known: bool = True, digest: str = D, round_: int = 5) -> dict[str, object]:
    """A member's gathered map, as it comes off the wire."""
    return {"id": "x", "round": round_, "digest": digest, "samples": 8, "roster": roster, "known": known}


def member(roster: int, known: bool = True, digest: str = D, round_: int = 5) -> Gathered:
    parsed = Gathered.parse(member_map(roster, known, digest, round_))
    assert parsed is not None
    return parsed


def statements(*maps: object) -> list[Gathered]:
    """What the members whose gathered maps are ``maps`` stated (unreadable ones: nothing)."""
    return [parsed for data in maps if (parsed := Gathered.parse(data)) is not None]


def test_a_majority_of_the_roster_lands_a_minority_does_not() -> None:
    assert verdict([member(10)] * 6, min_group_size=2).lands
    minority = verdict([member(10)] * 5, min_group_size=2)
    assert not minority.lands and "roster of 10" in minority.reason


@pytest.mark.parametrize("roster", [3, 4, 7, 10])
def test_no_two_disjoint_groups_of_one_roster_both_land(roster: int) -> None:
    # every split of the roster's members (and the dead ones) into two groups: at most one lands
    for size_a in range(1, roster + 1):
        for size_b in range(1, roster - size_a + 1):
            a = verdict([member(roster)] * size_a, min_group_size=2).lands
            b = verdict([member(roster)] * size_b, min_group_size=2).lands
            assert not (a and b), (roster, size_a, size_b)


def test_newcomers_hold_the_state_but_only_the_roster_counts() -> None:
    # 6 of a roster of 10 plus 2 peers that downloaded the state (they gather the published roster)
    assert verdict([member(10)] * 6 + [member(10, known=False)] * 2, min_group_size=2).lands
    # 4 of them plus 4 newcomers: not the roster's majority (a group of 6 may land beside it)
    assert not verdict([member(10)] * 4 + [member(10, known=False)] * 4, min_group_size=2).lands
    assert not verdict([member(10, known=False)] * 9, min_group_size=2).lands


def test_stale_members_neither_count_nor_claim() -> None:
    group = [member(4)] * 2 + [member(1, digest=E, round_=4)] * 3
    # the agreed state is the stale majority's? no: the newest round decides (round 5, 2 holders)
    found = verdict(group, min_group_size=2)
    assert found.holders == 2 and found.roster == 4 and not found.lands


def test_without_a_claimed_roster_min_group_size_decides() -> None:
    assert verdict([member(0, known=False)] * 2, min_group_size=2).lands
    assert not verdict([member(0, known=False)] * 2, min_group_size=3).lands


def test_one_liar_does_not_move_the_claimed_roster() -> None:
    assert claimed_roster([10, 10, 10, 1]) == 10
    assert claimed_roster([3, 5]) == 5  # a tie: the larger (never lands a smaller group)
    assert not verdict([member(10)] * 3 + [member(1)], min_group_size=2).lands


@pytest.mark.parametrize(
    "bad",
    [None, "text", {"round": 5}, {"round": 5, "digest": D, "roster": -1}, {"round": 5, "digest": D, "roster": 2**40}],
)
def test_malformed_metadata_claims_nothing(bad: object) -> None:
    found = verdict([member(6)] * 4 + statements(bad), min_group_size=2)
    assert found.roster == 6 and found.holders in (4, 5)


def test_no_agreed_state_lands_nothing() -> None:
    found = verdict([member(2), member(2, digest=E)], min_group_size=2)
    assert not found.lands and "agree on no state" in found.reason


def test_the_leader_closes_once_every_known_member_is_in() -> None:
    assert not leader_may_close([member(3)] * 2)
    assert leader_may_close([member(3)] * 3)
    assert leader_may_close([member(3)] * 3 + [member(3, known=False)])
    assert not leader_may_close([member(3)] * 2 + [member(3, known=False)] * 3)  # waits for the third
    assert not leader_may_close([member(0, known=False)] * 5)  # no roster: the window decides


def test_the_roster_of_a_landed_state_is_its_in_sync_members() -> None:
    group = [member(7)] * 3 + [member(7, digest=E, round_=4)]
    assert in_sync_count(group) == 3


def test_a_peer_releases_its_roster_after_repeated_refusals() -> None:
    book = RosterBook()
    book.landed([member(9)] * 9)
    assert (book.size, book.known) == (9, True)
    refusal = verdict([member(9)] * 3, min_group_size=2)
    for attempt in range(1, ROSTER_RELEASE_AFTER):
        book.refused(refusal, D)
        assert book.size == 9, attempt
    book.refused(refusal, D)
    assert (book.size, book.known) == (0, True)  # it claims no size, and is still one of the roster
    book.adopted(RosterClaim(4, frozenset()), round_=6, me="x")
    assert (book.size, book.known) == (4, False)
    book.refused(refusal, D)
    book.refused(refusal, E)  # another state: the count starts again
    assert book.size == 4


def test_members_that_released_their_roster_count_toward_a_newcomers_claim_of_it() -> None:
    """Two members of a roster of 3 released it (their rounds found no group while their relays
    were gone); a newcomer that adopted the state before the release still claims the size.
    The two are 2 of the 3 members: their group with it lands, and its leader may close once
    the third is gone. Before, released members counted as unknown and every such group failed
    until the newcomer released too."""
    book = RosterBook()
    book.landed([member(3)] * 3)
    for _ in range(ROSTER_RELEASE_AFTER):
        book.refused(verdict([member(3)], min_group_size=2), D)
    released = member(book.size, known=book.known)
    newcomer = member(3, known=False)
    group = [released, released, newcomer]
    found = verdict(group, min_group_size=2)
    assert found.lands and found.roster == 3, found
    assert not leader_may_close(group)  # the third member: the leader asks whether it is there
    assert leader_may_close(group, left={"gone"})
    # one released member and the newcomer: 1 of 3 is no majority, as before the release
    assert not verdict([released, newcomer], min_group_size=2).lands
    # nobody claims a size any longer: the group needs min_group_size holders, as before
    assert verdict([released, released], min_group_size=2).lands


def named(i: int, roster: int = 5, digest: str = D, round_: int = 5) -> Gathered:
    return replace(member(roster, digest=digest, round_=round_), id=f"p{i}")


def test_the_in_sync_ids_are_the_roster_by_name() -> None:
    group = [named(i) for i in range(4)] + [named(9, digest=E, round_=4)]
    assert in_sync_ids(group) == {"p0", "p1", "p2", "p3"}
    assert in_sync_ids([named(0, digest=D), named(1, digest=E)]) == frozenset()  # no agreement: nobody


GROUP = [named(i) for i in range(5)] + [named(9, digest=E, round_=4)]  # 5 in sync, 1 stale
ROSTER = frozenset(f"p{i}" for i in range(5))


def test_a_member_a_reducer_failed_is_in_the_roster_of_the_state_its_group_made() -> None:
    # p0's round did not land here (a reducer failed it); p1..p4 landed it and publish its roster of 5
    book = RosterBook()
    book.missed(5, GROUP, D)
    book.adopted(RosterClaim(5, ROSTER - {"p0"}), round_=6, me="p0")
    assert (book.size, book.known) == (5, True)  # the next round's leader need not wait for it


@pytest.mark.parametrize(
    ("claim", "round_", "me", "why"),
    [
        (RosterClaim(5, frozenset({"p1", "p2"})), 6, "p0", "only 2 of its 5 hold it: maybe another group's"),
        (RosterClaim(5, frozenset({"x1", "x2", "x3"})), 6, "p0", "held by strangers"),
        (RosterClaim(4, ROSTER - {"p0"}), 6, "p0", "another roster: not its group's state"),
        (RosterClaim(5, ROSTER - {"p0"}), 7, "p0", "a later round: made by a group it was not in"),
        (RosterClaim(5, ROSTER - {"p0"}), 6, "p9", "it was stale in that group: not in the roster"),
    ],
)
def test_a_downloaded_state_counts_its_taker_only_if_its_own_group_made_it(
    claim: RosterClaim, round_: int, me: str, why: str
) -> None:
    book = RosterBook()
    book.missed(5, GROUP, D)
    book.adopted(claim, round_=round_, me=me)
    assert (book.size, book.known) == (claim.size, False), why


def test_only_the_next_download_after_a_missed_round_can_count() -> None:
    book = RosterBook()
    book.missed(5, GROUP, D)
    book.refused(verdict([named(0)], min_group_size=2), D)  # a later round failed too: the miss is stale
    book.adopted(RosterClaim(5, ROSTER - {"p0"}), round_=6, me="p0")
    assert not book.known
    book.missed(5, GROUP, D)
    book.landed(GROUP)
    book.adopted(RosterClaim(5, ROSTER - {"p0"}), round_=6, me="p0")
    assert not book.known


def test_a_follower_s_malformed_bytes_are_no_metadata() -> None:
    from hivemind.utils import MSGPackSerializer

    good = MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(member_map(2))])
    assert gathered_metadata(good) == member(2)
    for bad in (b"", b"\xff\x00", MSGPackSerializer.dumps([1, 2]), MSGPackSerializer.dumps(7)):
        assert gathered_metadata(bad) is None


def test_a_grown_swarm_still_lands_at_most_one_group() -> None:
    # a roster of 4 and 3 newcomers, split every way into two groups: at most one lands
    people = [member(4)] * 4 + [member(4, known=False)] * 3
    for mask in range(1, 2 ** len(people) - 1):
        a = [p for i, p in enumerate(people) if mask >> i & 1]
        b = [p for i, p in enumerate(people) if not mask >> i & 1]
        assert not (verdict(a, min_group_size=2).lands and verdict(b, min_group_size=2).lands), mask


def _matchmaking(
    bound: int | None, smallest: int, me: Gathered | dict[str, object], followers: list[Gathered | dict[str, object]]
) -> Any:
    """A hivemind ``Matchmaking`` as hivemind leaves it after ``__init__`` (no P2P needed for
    the bounds), re-classed, leading ``followers``."""
    from types import SimpleNamespace

    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer, TimedStorage

    from engine.matchmaking import round_matchmaking

    def wire(data: Gathered | dict[str, object]) -> bytes:
        raw = data.to_wire() if isinstance(data, Gathered) else data
        return MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(raw)])

    made = object.__new__(Matchmaking)
    made.__dict__.update(target_group_size=bound, min_group_size=smallest, step_control=None, current_followers={})
    matchmaking = round_matchmaking(made)
    matchmaking.step_control = SimpleNamespace(data_for_gather=wire(me))
    matchmaking.current_followers = {
        PeerID(f"p{i}".encode()): SimpleNamespace(gather=wire(f)) for i, f in enumerate(followers)
    }
    # it declared to expire at DECLARED and has read the round's declarations (nobody earlier)
    matchmaking.peer_id = PeerID(b"me")
    matchmaking.potential_leaders = SimpleNamespace(
        max_assured_time=0.0, declared_expiration_time=DECLARED, leader_queue=TimedStorage()
    )
    return matchmaking


def test_the_leader_closes_when_the_roster_is_in_and_never_starts_a_refused_group() -> None:
    # a run's peer (no bound): open until the roster of 3 is in, then the group's size
    assert _matchmaking(None, 2, member(3), [member(3)]).target_group_size is None
    assert _matchmaking(None, 2, member(3), [member(3)] * 2).target_group_size == 3
    # 1 of a roster of 3 plus 2 newcomers cannot land: its window's end does not start it
    refused = _matchmaking(None, 2, member(3), [member(3, known=False)] * 2)
    assert refused.min_group_size == 4
    assert _matchmaking(None, 2, member(3), [member(3)]).min_group_size == 2
    # a bare averager (a test's, a benchmark's) keeps the bound it was built with
    bare = _matchmaking(4, 2, {"x": 1}, [{"x": 2}])
    assert (bare.target_group_size, bare.min_group_size) == (4, 2)


def test_a_peer_with_an_earlier_leader_in_line_does_not_close_its_own_group() -> None:
    from types import SimpleNamespace

    from hivemind.p2p import PeerID
    from hivemind.utils import TimedStorage

    complete = _matchmaking(None, 2, member(3), [member(3)] * 2)
    assert complete.target_group_size == 3
    # a newcomer declared to expire before it: it follows that one (hivemind's order)
    earlier = DECLARED - 1
    complete.potential_leaders.leader_queue.store(PeerID(b"newcomer"), earlier, earlier)
    assert complete.target_group_size is None
    # one declared later and already in its group does not stop it
    later = _matchmaking(None, 2, member(3), [member(3)] * 2)
    follower = next(iter(later.current_followers))
    later.potential_leaders.leader_queue.store(follower, DECLARED + 1, DECLARED + 1)
    assert later.target_group_size == 3
    # nor may it close before it has read the round's declarations once
    unread = _matchmaking(None, 2, member(3), [member(3)] * 2)
    unread.potential_leaders = SimpleNamespace(
        max_assured_time=float("-inf"), declared_expiration_time=DECLARED, leader_queue=TimedStorage()
    )
    assert unread.target_group_size is None


def test_a_complete_roster_waits_a_grace_for_peers_declared_at_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A newcomer declared at the round's key joins one DHT lookup after the roster's members:
    the leader waits up to ``JOIN_GRACE_S`` for it, and no longer (a forged declaration)."""
    from hivemind.p2p import PeerID

    import engine.matchmaking as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    leader = _matchmaking(None, 2, member(3), [member(3)] * 2)
    newcomer = PeerID(b"newcomer")
    leader.potential_leaders.leader_queue.store(newcomer, DECLARED + 1, DECLARED + 1)
    assert leader.target_group_size is None
    clock[0] += module.JOIN_GRACE_S / 2
    assert leader.target_group_size is None  # the grace runs from the first time the roster was complete
    clock[0] += module.JOIN_GRACE_S / 2
    assert leader.target_group_size == 3  # it never came: the roster's group starts
    # it joins within the grace: the group closes with it at once
    joined = _matchmaking(None, 2, member(3), [member(3)] * 2)
    joined.potential_leaders.leader_queue.store(newcomer, DECLARED + 1, DECLARED + 1)
    assert joined.target_group_size is None
    joined.current_followers[newcomer] = next(iter(joined.current_followers.values()))
    assert joined.target_group_size == 4
    # an incomplete roster waits for its window as before, declared peers or not
    short = _matchmaking(None, 2, member(3), [member(3)])
    short.potential_leaders.leader_queue.store(newcomer, DECLARED + 1, DECLARED + 1)
    clock[0] += 10 * module.JOIN_GRACE_S
    assert short.target_group_size is None


def test_a_join_request_that_waited_past_half_its_senders_timeout_is_turned_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its sender has given up (or is about to) and hivemind would still count it in the group:
    a member that never takes part, failing the round for every other member."""
    from types import SimpleNamespace

    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.proto import averaging_pb2

    import engine.matchmaking as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    hivemind_reason: list[Any] = [None]
    monkeypatch.setattr(Matchmaking, "_check_reasons_to_reject", lambda self, request, context: hivemind_reason[0])
    leader = _matchmaking(None, 2, member(3), [member(3)])
    leader.request_timeout = 1.0
    fresh, stale = SimpleNamespace(remote_id="a"), SimpleNamespace(remote_id="b")
    leader.note_arrival(stale)
    clock[0] += 0.6
    leader.note_arrival(fresh)
    leader.note_arrival(stale)  # noted again further in: the first arrival counts
    assert leader._check_reasons_to_reject(None, fresh) is None
    turned = leader._check_reasons_to_reject(None, stale)
    assert turned is not None and turned.code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    # hivemind's own reasons come first
    hivemind_reason[0] = averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
    assert leader._check_reasons_to_reject(None, stale).code == averaging_pb2.BAD_GROUP_KEY
    # a call that ended leaves nothing behind
    leader.forget_arrival(stale)
    leader.forget_arrival(fresh)
    assert leader.__dict__["_arrivals"] == {}


def _named(name: str, roster: int = 3, known: bool = True, round_: int = 5) -> Gathered:
    parsed = Gathered.parse({**member_map(roster, known, D, round_), "id": name})
    assert parsed is not None
    return parsed


def test_a_roster_member_that_left_cleanly_is_not_waited_for_and_lowers_no_majority() -> None:
    group = [_named("a"), _named("b")]
    assert not leader_may_close(group)
    assert leader_may_close(group, left={"c"})
    assert not leader_may_close(group, left={"a"})  # a member in the group is no leaver
    # the verdict still counts the whole roster: 2 of 3 land, 1 of 3 with two "leavers" does not
    assert verdict(group, min_group_size=2).lands
    assert leader_may_close(group[:1], left={"b", "c"}) and not verdict(group[:1], min_group_size=1).lands


def test_only_the_rosters_own_signed_leaves_of_the_agreed_state_count() -> None:
    from protocol.identity import Identity
    from protocol.roster import leavers, produced_state
    from protocol.statesync import make_digest_record, parse_digest_record

    keys = {name: Identity.generate() for name in ("a", "b", "c", "stranger")}
    ids = {name: key.public_key.id for name, key in keys.items()}
    group = [_named(ids["a"]), _named(ids["b"])]
    now = time.time()

    def record(name: str, *, leaving: bool = True, digest: str = D, round_: int = 5) -> Any:
        raw = make_digest_record(keys[name], round_=round_, digest=digest, now=now, roster=3, leaving=leaving)
        return parse_digest_record(raw, now=now)

    roster = {ids["a"], ids["b"], ids["c"]}
    assert leavers(group, roster, [record("c")]) == {ids["c"]}
    assert leavers(group, roster, [record("c", leaving=False)]) == set()  # holds it, still coming
    assert leavers(group, roster, [record("stranger")]) == set()  # not of this roster
    assert leavers(group, roster, [record("c", digest=E)]) == set()  # another state
    assert leavers(group, roster, [record("c", round_=4)]) == set()
    assert leavers(group, roster, [record("a")]) == set()  # in the group
    # the group that made the state: round 4's members, in sync, by name
    made = [_named(ids[n], round_=4) for n in ("a", "b", "c")]
    assert produced_state(made) == (5, frozenset(roster))


def test_a_leaving_flag_that_is_not_a_boolean_is_refused() -> None:
    import json

    from protocol.errors import MalformedMessageError
    from protocol.identity import Identity
    from protocol.messages import sign_message
    from protocol.statesync import DIGEST_KIND, parse_digest_record

    body = json.dumps({"round": 5, "digest": D, "leaving": "yes"}).encode()
    raw = sign_message(Identity.generate(), DIGEST_KIND, body, now=time.time()).to_bytes()
    with pytest.raises(MalformedMessageError, match="leaving"):
        parse_digest_record(raw, now=time.time())


def test_a_later_round_landed_outside_the_group_fences_a_group_without_a_roster() -> None:
    """``landed_beside``: only a record landed by averaging, recently, outside the group, by a
    signer whose vote counts, says another group landed the round; a stranger (keys are free),
    an adopter, an archive, a member of this very group that landed first, and a dead peer's
    record from a timeline the swarm rolled back from say nothing."""
    from protocol.identity import Identity
    from protocol.statesync import DigestRecord

    def record(round_: int, landed: float | None, *, archive: bool = False) -> DigestRecord:
        return DigestRecord(Identity.generate().public_key, round_, "blake3:" + "1" * 64, archive, landed=landed)

    beside = record(6, 1_000.0)
    partner = record(6, 1_000.0)
    stranger = record(6, 1_000.0)
    quiet = [record(6, None), record(6, 1_000.0, archive=True), record(5, 1_000.0), record(9, 100.0)]
    records = [beside, partner, stranger, *quiet]
    eligible = {r.signer.id for r in records if r is not stranger}.__contains__
    found = landed_beside(records, round_=5, group={partner.signer.id}, eligible=eligible, since=900.0)
    assert found == {beside.signer.id}
    assert not landed_beside(quiet + [partner], round_=5, group={partner.signer.id}, eligible=eligible, since=900.0)


def test_a_matchmaking_hands_its_rosters_to_the_next_one_of_its_peer() -> None:
    """A relayed peer that moves its swarm to a new relay restarts its averager
    (``peer.swarm.swarm.Swarm.move_to``): the new matchmaking takes the rosters the old one noted, by
    name and libp2p id, across processes (they pickle), so that the next round's leader can
    ask a missing member whether it is there instead of waiting out its window; what the new
    one noted itself wins, and no more than ``ROSTERS_KEPT`` are kept."""
    import pickle

    from hivemind.p2p import PeerID

    from engine.matchmaking import ROSTERS_KEPT

    old = _matchmaking(None, 2, member(3), [])
    made = [named(i, roster=3, round_=r) for r in (1, 2, 3, 4, 5) for i in range(3)]
    for r in (1, 2, 3, 4, 5):
        old.note_group([m for m in made if m.round == r], peers={f"p{i}": PeerID(f"q{i}".encode()) for i in range(3)})
    kept = pickle.loads(pickle.dumps(old.kept_rosters()))
    assert sorted(kept) == [3, 4, 5, 6][-ROSTERS_KEPT:]
    assert kept[6] == (frozenset({"p0", "p1", "p2"}), {f"p{i}": f"q{i}".encode() for i in range(3)})

    new = _matchmaking(None, 2, member(3), [])
    new.note_group([named(7, roster=2, round_=5), named(8, roster=2, round_=5)])  # its own view of round 6's state
    new.keep_rosters(kept)
    mine = new.kept_rosters()
    assert mine[6][0] == {"p7", "p8"}  # its own, not the handed one
    assert mine[5] == kept[5] and new.__dict__["_roster_peers"][5]["p1"] == PeerID(b"q1")
    assert len(mine) <= ROSTERS_KEPT


def test_a_leader_whose_members_released_the_roster_closes_once_the_roster_it_saw_is_back() -> None:
    """Its members released the roster's size (rounds without a group while their relays were
    gone): nobody claims one, so the claimed roster cannot end the wait. The leader saw the
    group of p0, p1 and p2 make the state: once p1 and p2 are back (or one is in and the other
    did not answer), it starts the round instead of waiting out its window; without that
    roster, or with a member still missing, it waits as before."""
    released = [named(i, roster=0) for i in range(3)]
    for member_ in released:
        assert member_.known and member_.roster == 0

    def leader(followers: list[Gathered], saw: bool = True) -> Any:
        made = _matchmaking(None, 2, released[0], followers)
        if saw:  # the group that made round 5's state: p0, p1, p2 (at round 4)
            made.note_group([named(i, roster=3, round_=4) for i in range(3)])
        return made

    assert leader(released[1:]).target_group_size == 3
    assert leader(released[1:], saw=False).target_group_size is None  # the window decides
    assert leader(released[1:2]).target_group_size is None  # p2 may still come
    one_gone = leader(released[1:2])
    one_gone.__dict__["_left_seen"] = (one_gone.step_control, frozenset(), frozenset({"p2"}))
    assert one_gone.target_group_size == 2
    # a newcomer beside them changes nothing: the roster it saw is in
    newcomer = replace(member(0, known=False), id="new")
    assert leader([*released[1:], newcomer]).target_group_size == 4
