"""One group per round: hivemind's matchmaking with no size bound and a leader that starts the
all-reduce as soon as the whole roster is in (``protocol.roster.leader_may_close``).

hivemind's leader (the looking peer with the earliest declared expiration) closes its group
when ``target_group_size`` peers joined or when its expiration comes. A bound on the size
splits a swarm larger than it into several groups, each landing another state; so the run's
group has no bound, and every peer declares an expiration near its deadline
(``Swarm.start_round``: a long window), so peers that launch a phase apart still find the
same leader. A long window would make every round wait for it; instead the leader closes as
soon as every member of the roster of the group's state has joined (torchft's "fast
quorum": the previous round's members are all back), said it left, or does not answer when
asked whether it is there (``engine.liveness``: it died). Only a round whose roster lost a
member that is alive but late waits out the window. A complete roster still waits, up to
``JOIN_GRACE_S``, for peers declared at the round's key that have not joined yet: a newcomer
(or a member back from a failure) is declared there before the roster's members arrive, and
its join request follows their declarations by one DHT lookup; closing on the roster alone
left it out of every round whose roster completed within that lookup. Safety does not rest on
this: the roster rule (``protocol.roster.verdict``) decides which group's state lands.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS as TIME_DISCREPANCY_S

from engine.group_start import GroupStartMixin
from engine.liveness import PROBE_AFTER_S, silent
from protocol.gathered import Gathered
from protocol.roster import leader_may_close, leavers, produced_state, verdict
from protocol.statesync import collect_records, digest_key

__all__ = [
    "KeptRosters",
    "PacedKeyManager",
    "RoundMatchmaking",
    "RoundPotentialLeaders",
    "equal_shares",
    "gathered_metadata",
    "round_group_bits",
    "round_matchmaking",
]

logger = logging.getLogger(__name__)

KeptRosters = dict[int, tuple[frozenset[str], dict[str, bytes]]]
"""The rosters a matchmaking remembers, by the round of the state each made: the members' public
ids and their libp2p peer ids as bytes (``RoundMatchmaking.kept_rosters``; picklable, to cross
from the averager's process to the next averager's)."""

STALE_REQUEST_FRACTION = 0.5
"""A join request that waited longer than this fraction of ``request_timeout`` before the
leader could answer it is turned away (``RoundMatchmaking._check_reasons_to_reject``)."""
LEAVE_POLL_S = 1.0
"""How often a leader waiting for its roster reads the run's digest records for members that
left cleanly (``protocol.roster.leavers``): one DHT lookup a second, by the round's leader only."""
ROSTERS_KEPT = 4
JOIN_GRACE_S = 2.0
"""How long a leader whose roster is complete waits for peers declared at its round's key that
have not joined (``RoundMatchmaking.target_group_size``): one DHT lookup and one join request
of theirs. Anyone can declare at a key, so this is also the most a forged declaration delays a
round."""

FIRST_LOOKUP_PAUSE_S = 0.05
"""The pause before an averager's second lookup of a round's declarations; each further pause
doubles, up to ``LOOKUP_PAUSE_MAX_S`` (``PacedKeyManager``)."""
LOOKUP_PAUSE_MAX_S = 0.25
"""The longest pause between two lookups of one round's declarations by one averager."""


def gathered_metadata(gather: bytes) -> Gathered | None:
    """The member's statement (``protocol.gathered``) inside hivemind's gathered bytes
    ``[bandwidth, mode, user bytes]`` (None if malformed: a follower's bytes are untrusted input)."""
    try:
        _bandwidth, _mode, user = MSGPackSerializer.loads(gather)
        return Gathered.parse(MSGPackSerializer.loads(user))
    except Exception:  # noqa: BLE001 - any malformed payload is just "no metadata"
        return None


def equal_shares(gathered: Sequence[bytes]) -> tuple[bytes, ...]:
    """The members' gathered bytes ``[bandwidth, mode, user bytes]`` with every bandwidth
    replaced by None: hivemind then gives each member that reduces an equal share of the
    vector. The bandwidth is what a member says about itself; hivemind's load balancing took it
    unchecked, so NaN failed the group's round in every member (an assertion) and infinity
    handed the liar 80% of the vector to reduce. Honest peers send None (the run sets no
    bandwidth), so their rounds are unchanged. The mode is a claim too: a client (it cannot be
    dialled) stays one, anything else is a full member (no swarmtrain peer is hivemind's
    auxiliary, which reduces without sending: one that claims it is then a sender that sent
    nothing, and a reducer that cannot serve its own part to an audit; a mode hivemind cannot
    read failed the group's round in every member). Bytes that do not parse are left as they
    are (hivemind refuses the group)."""
    shares = []
    for data in gathered:
        try:
            _bandwidth, mode, user = MSGPackSerializer.loads(data)
        except Exception:  # noqa: BLE001 - a malformed member's bytes: hivemind's own check refuses them
            shares.append(data)
            continue
        mode = AveragingMode.CLIENT.value if mode == AveragingMode.CLIENT.value else AveragingMode.NODE.value
        shares.append(MSGPackSerializer.dumps([None, mode, user]))
    return tuple(shares)


def round_group_bits(round_: int) -> str:
    """hivemind's group bits (its DHT key is ``PREFIX.0b<bits>``) of the round ``round_``: each
    round's peers meet under a key of their own."""
    return format(round_, "b")


class PacedKeyManager(GroupKeyManager):
    """hivemind's ``GroupKeyManager`` whose lookups of one round's declarations back off: the
    first at once, then after ``FIRST_LOOKUP_PAUSE_S``, each pause twice the last, up to
    ``LOOKUP_PAUSE_MAX_S``; a new round's key starts over. hivemind's search looks again as
    soon as a lookup is read whenever it has no earlier leader to ask (a leader waiting for
    its roster, a follower whose leader has not declared yet), so without a pause every
    waiting peer spins DHT lookups for its whole window: thousands a minute from one waiting
    peer of a 3-peer test swarm, which kept its DHT process and p2pd busy; in a public run the
    few DHT nodes that hold a round's key would take the spins of hundreds. A group that forms
    quickly sees no pause; a peer waiting long sees a new leader at most a quarter second late
    (a 1 s cap made round formation at 64 members ~0.6 s slower, ``benchmarks.round_formation``:
    members that looked before their leader's declaration arrived found it late)."""

    async def declare_averager(
        self, group_key: Any, peer_id: Any, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        """hivemind's, but a withdrawal (``looking_for_group=False``, at the end of a search) is
        stored in the background. hivemind withdraws as its search unwinds, under the lock that
        lets one search run at a time; a DHT store waits for its slowest replica (seconds on a
        home link, an RPC timeout when one is gone), so a search given up
        (``peer.round.landing.Landing.abandon_if_landed``) held up the next round's search that long
        ("Another look_for_group is already in progress"), and its peer lost that round too. A
        withdrawal is only a hint (others ask a withdrawn peer and are turned away), and it
        cannot undo a newer declaration: the DHT keeps the later expiration."""
        if looking_for_group:
            return bool(await super().declare_averager(group_key, peer_id, expiration_time, looking_for_group))
        tasks: set[asyncio.Task[Any]] = self.__dict__.setdefault("_withdrawals", set())
        task = asyncio.create_task(super().declare_averager(group_key, peer_id, expiration_time, False))
        tasks.add(task)
        task.add_done_callback(_withdrawn(tasks))
        return True

    async def get_averagers(self, group_key: Any, only_active: bool) -> Any:
        state = self.__dict__.get("_paced")
        if state is None or state[0] != group_key:
            state = (group_key, -math.inf, 0.0)  # a new key: look at once
        _key, last, pause = state
        wait = last + pause - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        following = FIRST_LOOKUP_PAUSE_S if pause == 0.0 else min(LOOKUP_PAUSE_MAX_S, 2 * pause)
        self.__dict__["_paced"] = (group_key, time.monotonic(), following)
        return await super().get_averagers(group_key, only_active)


def _withdrawn(tasks: set[asyncio.Task[Any]]) -> Any:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("could not withdraw this peer's declaration: %s", task.exception())

    return done


class RoundPotentialLeaders(PotentialLeaders):
    """hivemind's search for a leader, which looks at the round's declarations again for as long
    as it searches (and is not following a leader).

    hivemind stops looking once the earliest declared peer it knows would lead after its own
    search ends, on the premise that a peer that declares later expires later (each declares
    now + the same window). A round's peers declare windows of their own length (each one's
    adaptive matchmaking timeout, ``peer.round.timeouts``), so a peer that launches late can declare
    the earliest expiration and lead the round: the others, no longer looking, never asked it,
    it failed the round alone, and they waited out their windows as a smaller group (three
    peers behind NAT lost a round so on a loaded machine). The lookups stay paced
    (``PacedKeyManager``): at most one every ``LOOKUP_PAUSE_MAX_S`` once a wait is long."""

    async def _update_queue_periodically(self, key_manager: GroupKeyManager) -> None:
        while get_dht_time() < self.search_end_time:
            declared = await key_manager.get_averagers(key_manager.current_key, only_active=True)
            # hivemind's mark of a search that has read the declarations (``RoundMatchmaking._first_in_line``)
            assured: float = self.__dict__["max_assured_time"]
            self.max_assured_time = max(assured, get_dht_time() + self.min_matchmaking_time - TIME_DISCREPANCY_S)
            self.leader_queue.clear()
            for peer, expiration in declared:
                if peer == self.peer_id or (peer, expiration) in self.past_attempts:
                    continue
                self.leader_queue.store(peer, expiration, expiration)
                self.max_assured_time = max(self.max_assured_time, expiration - TIME_DISCREPANCY_S)
            self.update_finished.set()
            left = self.search_end_time - get_dht_time()
            if not self.running.is_set():  # following a leader (``pause_search``): look again once back
                try:
                    await asyncio.wait_for(self.running.wait(), timeout=left if math.isfinite(left) else None)
                except TimeoutError:
                    return
            self.update_triggered.clear()


class RoundMatchmaking(GroupStartMixin, Matchmaking):
    """hivemind's ``Matchmaking`` whose size bound is read at each join: the group's current
    size once the roster is complete (hivemind then assembles the group at once), else the
    bound it was built with (a run's peers: none; a bare averager of a test or benchmark may
    set one, as in hivemind)."""

    @property
    def target_group_size(self) -> int | None:
        bound: int | None = self.__dict__.get("_bound")
        followers = getattr(self, "current_followers", {})
        if not followers or getattr(self, "step_control", None) is None:
            return bound
        metadata = self._metadata()  # parsed once per round (the bound is read at every join)
        members = [data for data in metadata if data is not None]
        left = self._left()
        if not self._may_close(members, left):
            self._watch_leaves(members)
        elif self._first_in_line():
            if self._grace_left() > 0:
                return bound
            if self.__dict__.get("_closed_step") is not self.step_control:  # hivemind reads the bound twice
                self.__dict__["_closed_step"] = self.step_control
                clean, gone = self._left_parts()
                logger.info(
                    "the roster is complete (%d members%s%s): starting the round's all-reduce",
                    len(metadata),
                    f", {len(clean)} more left cleanly" if clean else "",
                    f", {len(gone)} more did not answer" if gone else "",
                )
            return len(metadata)
        return bound

    @target_group_size.setter
    def target_group_size(self, value: int | None) -> None:
        self.__dict__["_bound"] = value

    def note_group(self, members: Sequence[Gathered], peers: dict[str, PeerID] | None = None) -> None:
        """Remember the roster, by name, of the state the group of ``members`` makes (the
        averager calls this once its all-reduce is done), and where its members are (``peers``:
        public id to libp2p peer id): the next round's leader counts a leave only from those,
        and asks those it misses whether they are there (``_watch_leaves``)."""
        produced = produced_state(members)
        if produced is None:
            return
        rosters: dict[int, frozenset[str]] = self.__dict__.setdefault("_rosters", {})
        rosters[produced[0]] = produced[1]
        where: dict[int, dict[str, PeerID]] = self.__dict__.setdefault("_roster_peers", {})
        where[produced[0]] = {name: peer for name, peer in (peers or {}).items() if name in produced[1]}
        for old in sorted(rosters)[:-ROSTERS_KEPT]:
            del rosters[old]
            where.pop(old, None)

    def kept_rosters(self) -> KeptRosters:
        """The rosters this matchmaking remembers (``note_group``), to hand to the next one of
        this peer (``keep_rosters``): a relayed peer that moves its swarm to a new relay
        restarts its averager, and a leader that forgot the roster of its state could neither
        count a leave nor ask a missing member whether it is there: it waited out its window."""
        rosters: dict[int, frozenset[str]] = self.__dict__.get("_rosters", {})
        where: dict[int, dict[str, PeerID]] = self.__dict__.get("_roster_peers", {})
        return {
            round_: (ids, {name: peer.to_bytes() for name, peer in where.get(round_, {}).items()})
            for round_, ids in rosters.items()
        }

    def keep_rosters(self, kept: KeptRosters) -> None:
        """Remember ``kept`` (another matchmaking's ``kept_rosters`` of this peer) beside what
        this one noted itself, which wins."""
        rosters: dict[int, frozenset[str]] = self.__dict__.setdefault("_rosters", {})
        where: dict[int, dict[str, PeerID]] = self.__dict__.setdefault("_roster_peers", {})
        for round_, (ids, peers) in kept.items():
            if round_ not in rosters:
                rosters[round_] = frozenset(ids)
                where[round_] = {name: PeerID(peer) for name, peer in peers.items() if name in ids}
        for old in sorted(rosters)[:-ROSTERS_KEPT]:
            del rosters[old]
            where.pop(old, None)

    def _may_close(self, members: Sequence[Gathered], left: frozenset[str]) -> bool:
        """Whether this leader may start the all-reduce before its window ends: the roster its
        group's holders claim is in or left (``protocol.roster.leader_may_close``), or, where
        they claim none (they released it after rounds without a group,
        ``peer.round.roster_book.RosterBook.refused``), every member of the roster this peer saw make
        the group's state, by name, is in the group or left, and the group lands by the rule.
        Closing picks who is in the round, never which state lands (``protocol.roster.verdict``
        does); without this, the first round after an outage that made the members release
        waited out its whole window although all of them were back."""
        if leader_may_close(members, left):
            return True
        produced = produced_state(members)
        roster = self.__dict__.get("_rosters", {}).get(produced[0] - 1) if produced is not None else None
        if not roster:
            return False
        present = {data.id for data in members if data.id}
        smallest: int = self.__dict__.get("_min_group_size", 1)
        return roster <= present | left and verdict(list(members), min_group_size=smallest).lands

    def _left(self) -> frozenset[str]:
        """Roster members of this step's state that left cleanly or did not answer, as last read."""
        clean, gone = self._left_parts()
        return clean | gone

    def _left_parts(self) -> tuple[frozenset[str], frozenset[str]]:
        """(members of this step's roster that left cleanly, those that did not answer a probe)."""
        seen = self.__dict__.get("_left_seen")
        if seen is None or seen[0] is not self.step_control:
            return frozenset(), frozenset()
        return seen[1], seen[2]

    def _watch_leaves(self, members: Sequence[Gathered]) -> None:
        """While this leader waits for its roster, read every ``LEAVE_POLL_S`` which of the
        roster left cleanly holding the state (``protocol.roster.leavers``: signed digest records
        marked ``leaving``, from the roster of the state as this peer saw its group make it),
        and, once it has waited ``PROBE_AFTER_S``, ask the members still missing whether they
        are there (``engine.liveness``); once the others are in, gone or silent, close. One
        watcher per step."""
        step = self.step_control
        produced = produced_state(members)  # the round after the state the group starts from
        if produced is None:
            return
        roster = self.__dict__.get("_rosters", {}).get(produced[0] - 1)
        if not roster or self.__dict__.get("_leave_watch") is step:
            return  # this peer did not see the state made: it counts no leave
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.__dict__["_leave_watch"] = step
        where: dict[str, PeerID] = self.__dict__.get("_roster_peers", {}).get(produced[0] - 1, {})
        key = digest_key(self.group_key_manager.prefix)
        started = time.monotonic()

        async def read_leavers() -> list[Any]:
            try:
                found = await self.group_key_manager.dht.get(key, latest=True, return_future=True)
                value = found.value if found is not None else None
                return collect_records(value, now=get_dht_time()) if isinstance(value, dict) else []
            except Exception as exc:  # noqa: BLE001 - a DHT hiccup: look again
                logger.debug("could not read the digest records: %s", exc)
                return []

        async def probe(missing: frozenset[str]) -> frozenset[str]:
            if time.monotonic() - started < PROBE_AFTER_S:
                return frozenset()
            peers = {where[name]: name for name in sorted(missing) if name in where}
            return frozenset(peers[peer] for peer in await silent(self._ask_alive, list(peers)))

        async def watch() -> None:
            gone: frozenset[str] = frozenset()
            while self.step_control is step and self.is_looking_for_group and not self.assembled_group.done():
                present = {data.id for data in self._metadata() if data is not None and data.id}
                missing = frozenset(roster - present - gone)
                records, silence = await asyncio.gather(read_leavers(), probe(missing))
                if self.step_control is not step:  # the search ended during the lookup
                    return
                current = [data for data in self._metadata() if data is not None]
                left = leavers(current, roster, records)
                now_present = {data.id for data in current if data.id}
                gone = frozenset((gone | silence) - left - now_present)
                if (left, gone) != self._left_parts():
                    self.__dict__["_left_seen"] = (step, left, gone)
                    if silence - left - now_present:
                        logger.info("%d member(s) of the roster do not answer: not waiting for them", len(gone))
                    if self._may_close(current, left | gone):
                        self._close_after(0.0, step)
                await asyncio.sleep(LEAVE_POLL_S)

        self.__dict__["_leave_task"] = loop.create_task(watch())

    async def _ask_alive(self, peer: PeerID) -> Any:
        """One probe of ``peer`` (``engine.liveness.LivenessMixin.rpc_alive``)."""
        stub = self._servicer_type.get_stub(self._p2p, peer, namespace=self._prefix)
        return await stub.rpc_alive(averaging_pb2.AveragingData())

    def _first_in_line(self) -> bool:
        """Whether this peer leads: it has read the round's declarations at least once since it
        declared, and none of them would lead before it (hivemind's order: earliest declared
        expiration, then peer id). A peer that is itself to follow an earlier leader (a
        newcomer that launched first, say) must not close its own group: that would split the
        round, the earlier leader's group and its own."""
        search = self.potential_leaders
        if search.max_assured_time == float("-inf"):
            return False
        mine = (search.declared_expiration_time, self.peer_id.to_bytes())
        return all((entry.expiration_time, peer.to_bytes()) > mine for peer, entry in search.leader_queue.items())

    def _declared_outsiders(self) -> list[Any]:
        """Peers declared at this round's key, looking for a group, that are not in this
        leader's group. A gated run counts them too: a newcomer's token is often newer than the
        gate's last lookup, and its join request is checked when it comes."""
        followers = getattr(self, "current_followers", {})
        return [peer for peer, _entry in self.potential_leaders.leader_queue.items() if peer not in followers]

    def _grace_left(self) -> float:
        """Seconds this leader, its roster complete, still waits for the declared peers that have
        not joined (``JOIN_GRACE_S`` from when it first found its roster complete; 0: none
        declared, or the grace is over). While it waits, a re-check is scheduled for its end."""
        step = self.step_control
        outsiders = self._declared_outsiders()
        if not outsiders:
            return 0.0
        since = self.__dict__.get("_complete_since")
        if since is None or since[0] is not step:
            since = (step, time.monotonic())
            self.__dict__["_complete_since"] = since
            logger.info(
                "the roster is complete; waiting up to %.1f s for %d peer(s) declared at the round's key to join",
                JOIN_GRACE_S,
                len(outsiders),
            )
            self._close_after(JOIN_GRACE_S, step)
        return max(0.0, since[1] + JOIN_GRACE_S - time.monotonic())

    def _close_after(self, delay_s: float, step: object) -> None:
        """Once ``delay_s`` has passed, start the group's all-reduce if ``step`` still waits with
        its roster in (no join comes to re-read the bound otherwise)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a unit test reading the bound): nothing to schedule
            return

        async def close() -> None:
            async with self.lock_request_join_group:
                if self.step_control is not step or self.assembled_group.done() or not self.is_looking_for_group:
                    return
                size = self.target_group_size
                if size is not None and len(self.current_followers) + 1 >= size:
                    await self.leader_assemble_group()

        def start() -> None:
            self.__dict__["_grace_task"] = loop.create_task(close())  # held: a bare task may be collected

        loop.call_later(delay_s + 0.01, start)

    async def look_for_group(self, step: Any) -> Any:
        """hivemind's search, with the CPU this averager's event loop spends on it noted from
        its start (``led``)."""
        self.__dict__["_search_cpu"] = time.thread_time()
        self.__dict__["_led"] = None
        if self.is_looking_for_group:  # hivemind waits for the last search to unwind first
            started = time.monotonic()
            async with self.lock_looking_for_group:
                pass
            logger.info("the last search took %.1f s to end before this one began", time.monotonic() - started)
        group = await super().look_for_group(step)
        return None if isinstance(group, GivenUp) else group

    async def give_up_search(self) -> bool:
        """End the search under way now, unless its group formed (``ExactAverager.abandon_search``):
        a leader's followers are sent away (hivemind tells each its group was disbanded: a
        ``GivenUp`` group holds nobody), and ``look_for_group`` returns no group and cleans up
        as after a timeout; the step does not retry. True if a search was ended."""
        async with self.lock_request_join_group:
            step = self.step_control
            if step is None or self.assembled_group.done():
                return False
            step._allow_retries = False  # hivemind's ``_step`` would look again until the deadline
            if self.current_followers:
                await self.leader_disband_group()
            self.assembled_group.set_result(GivenUp(b"", (), ()))
        return True

    async def _request_join_group(self, leader: Any) -> Any:
        """hivemind's, with a second ask of a leader that turned this peer away: hivemind never
        asks a leader twice in one search (``past_attempts``), and a request turned away for
        waiting behind the leader's lock (``_check_reasons_to_reject``: a slow peer's request held
        it) left its sender no leader to ask: it failed its round alone, and the leader's group,
        its roster short of it, waited out the leader's window (10 s of an 8 s phase in the lab).
        The second ask follows the next read of the declarations (a quarter second at most,
        ``PacedKeyManager``), and only while the leader is still declared looking."""
        group = await super()._request_join_group(leader)
        if group is None:
            step, asked_twice = self.__dict__.get("_asked_twice", (None, set()))
            if step is not self.step_control:
                step, asked_twice = self.step_control, set()
                self.__dict__["_asked_twice"] = (step, asked_twice)
            if leader not in asked_twice:
                asked_twice.add(leader)
                search = self.potential_leaders
                search.past_attempts -= {attempt for attempt in search.past_attempts if attempt[0] == leader}
        return group

    async def leader_assemble_group(self) -> Any:
        group = await super().leader_assemble_group()
        started = self.__dict__.get("_search_cpu")
        self.__dict__["_led"] = {
            "members": len(group.peer_ids),
            "loop_cpu_s": time.thread_time() - started if started is not None else float("nan"),
            **self.start_summary(group.group_id),
        }
        return group

    def led(self) -> dict[str, float] | None:
        """If this peer led the group of its last search: its size, the CPU seconds this
        averager's event loop spent from the search's start to assembling it (joins, the
        roster rule, serialising the group), the bytes it sent to start the round
        (``engine.group_start``: the whole group to at most ``start_fanout`` followers, a digest
        and a parent to each other one), how many followers got the whole group and the bytes
        of one whole start message."""
        led: dict[str, float] | None = self.__dict__.get("_led")
        return led

    def get_request_expiration_time(self) -> float:
        """The expiration a join request carries: how long its sender waits in the leader's group.
        A leader turns away a request whose expiration comes before its own (hivemind's
        ``BAD_EXPIRATION_TIME``: that sender should lead). A declared peer's is its declaration,
        as in hivemind. A client-mode peer never declares and cannot lead; hivemind would send
        its window, which ends before the leader's whenever it launched first, so every leader
        turned it away and it averaged nothing that round (docs/design/round.md, step 6). It sends its real
        limit instead, the end of its round's search: a leader that closes by then accepts it."""
        if self.client_mode and math.isfinite(self.potential_leaders.search_end_time):
            return float(self.potential_leaders.search_end_time)
        return float(super().get_request_expiration_time())

    def _metadata(self) -> list[Gathered | None]:
        """Every current member's gathered metadata (this peer's first), each parsed once per round."""
        followers = getattr(self, "current_followers", {})
        gathers = [self.step_control.data_for_gather] + [request.gather for request in followers.values()]
        cache: dict[bytes, Gathered | None] = self.__dict__.get("_parsed_gathers", {})
        cache = {data: cache[data] if data in cache else gathered_metadata(data) for data in gathers}
        self.__dict__["_parsed_gathers"] = cache
        return [cache[data] for data in gathers]

    def note_arrival(self, context: object) -> None:
        """The join request of the call ``context`` has just arrived
        (``AdmissionGateMixin.rpc_join_group`` calls this before anything that may wait, such
        as its admission lookup; the first note counts)."""
        self.__dict__.setdefault("_arrivals", {}).setdefault(id(context), time.monotonic())

    def forget_arrival(self, context: object) -> None:
        """The call ``context`` has ended."""
        self.__dict__.get("_arrivals", {}).pop(id(context), None)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        self.note_arrival(context)
        try:
            async for message in super().rpc_join_group(request, context):
                yield message
        finally:
            self.forget_arrival(context)

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> averaging_pb2.MessageFromLeader | None:
        """hivemind's reasons, and one more: the request waited here (for the admission lookup,
        or for this peer's own request to a leader to end: hivemind holds one lock for both)
        more than half of the time its sender waits for an answer (``request_timeout``). Its
        sender has given up on it or is about to, and hivemind would still count it in the
        group: a member that never takes part, whose range of the vector fails the round for
        every other member. Turned away, it asks another leader (or this one again)."""
        reason = super()._check_reasons_to_reject(request, context)
        if reason is not None:
            return reason
        arrived = self.__dict__.get("_arrivals", {}).get(id(context))
        waited = time.monotonic() - arrived if arrived is not None else 0.0
        if waited > STALE_REQUEST_FRACTION * self.request_timeout:
            logger.info(
                "turned away %s's join request: it waited %.2f s here, its sender gives up after %.2f s",
                context.remote_id,
                waited,
                self.request_timeout,
            )
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return None

    @property
    def min_group_size(self) -> int:
        """hivemind assembles a group whose window ended when it holds this many members: the
        run's ``min_group_size``, unless the group as it stands would fail the roster rule
        (``protocol.roster.verdict``): then one more than it holds, so the leader disbands it and
        keeps looking (its followers with it) until its deadline, rather than start a round
        that cannot land."""
        base: int = self.__dict__.get("_min_group_size", 1)
        if getattr(self, "step_control", None) is None:
            return base
        metadata = self._metadata()
        if verdict([data for data in metadata if data is not None], min_group_size=base).lands:
            return base
        return len(metadata) + 1

    @min_group_size.setter
    def min_group_size(self, value: int) -> None:
        self.__dict__["_min_group_size"] = value


class GivenUp(GroupInfo):
    """The "group" a given-up search resolves to (``RoundMatchmaking.give_up_search``): nobody is
    in it, so hivemind's ``rpc_join_group`` tells each waiting follower its group was disbanded
    (a plain None there fails its membership check with a TypeError, logged as an error, and
    the follower gets INTERNAL_ERROR), and ``look_for_group`` turns it into no group."""

    def __contains__(self, peer: object) -> bool:
        return False


def round_matchmaking(matchmaking: Matchmaking) -> RoundMatchmaking:
    """Turn the ``Matchmaking`` hivemind built inside the averager process into a
    ``RoundMatchmaking`` (same state; hivemind constructs it itself, so it is re-classed), its
    key manager into a ``PacedKeyManager`` and its search into a ``RoundPotentialLeaders``."""
    keys = matchmaking.__dict__.get("group_key_manager")  # (a unit test's bare matchmaking has none)
    if keys is not None and not isinstance(keys, PacedKeyManager):
        keys.__class__ = PacedKeyManager
    search = matchmaking.__dict__.get("potential_leaders")
    if search is not None and not isinstance(search, RoundPotentialLeaders):
        search.__class__ = RoundPotentialLeaders
    if not isinstance(matchmaking, RoundMatchmaking):
        bound = matchmaking.__dict__.pop("target_group_size", None)
        smallest = matchmaking.__dict__.pop("min_group_size", 1)
        matchmaking.__class__ = RoundMatchmaking
        matchmaking.__dict__["_bound"] = bound
        matchmaking.__dict__["_min_group_size"] = smallest
    return matchmaking
