"""The peer's side of the swarm: its DHT node and its averager, one round at a time.

The trainer writes this peer's (already error-compensated) pseudo-gradient into the averager's
shared vector (``Swarm.outbox``, no copy of its own); ``Swarm.start_round`` starts matchmaking
+ all-reduce in the averager's process, which writes the average into that same vector;
``PendingRound.result`` waits for it. Each member gathers to the group its public id, round,
samples and pre-round state digest, so after a round every peer knows who averaged with
whom, with what weight, and whether it started from the same state as the others.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging.control import StepControl
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from engine.averager import ExactAverager
from engine.bulk_settings import BulkSettings
from engine.compression import Codec, choose_kernels
from engine.dht_mend import keep_bootstrapped
from engine.dht_start import start_dht
from engine.outcome import GroupOutcome
from engine.p2p_identity import write_ed25519_identity
from engine.record_bounds import RunRecordBounds
from engine.records import RunRecords
from engine.robust import RobustRule
from engine.update_store import UpdateStore
from peer.round.swarm_port import (
    NEGLIGIBLE_WEIGHT,
    DownloadedState,
    FragmentAnswer,
    LentOutbox,
    RoundResult,
    StateProvider,
)
from peer.round.timeouts import matchmaking_window, matchmaking_windows
from peer.swarm.meeting import Meeting, Meetings, meeting_candidates
from peer.swarm.swarm_pace import LandingTimes, SwarmPace, landing_medians
from protocol.agreement import Agreement, agreed_state, agreed_states
from protocol.gathered import Gathered
from protocol.identity import Identity, PublicKey
from protocol.membership import MemberGate
from protocol.roster import RosterClaim, claimed_roster, landed_beside
from protocol.spec import RunSpec
from protocol.statesync import DigestRecord, record_votes, run_prefix
from protocol.tokens import decode_token
from protocol.updates import FetchedUpdate

logger = logging.getLogger(__name__)


LOOKUP_DECAY = 0.7
"""``Swarm.lookup_s`` forgets a slow lookup by this factor a read (a link's lag rises fast and
is believed to fall slowly)."""
RECORDS_FRESH_S = 1.0
"""A read of the digest records serves the calls of the next second (an adoption reads
them to check agreement, to learn the state's roster and to count the group, back to back: each
read costs a DHT lookup, about 0.6 s on a home link of 350 kbit/s)."""

PREFETCH_FRESH_S = 5.0
"""A read begun by ``Swarm.prefetch_records`` serves a later ``records`` call up to this long
after it began (the update download it ran beside takes a few seconds on a home link); an
older one is dropped and the records read again."""

JOINING_REQUEST_FACTOR = 4.0
"""A joining search (``start_round(joining=True)``) waits this many times hivemind's
``request_timeout`` for a leader's answer to its join request. A newcomer on a slow link,
right after its download and roll, has its link's queue full: in the join lab (220 kbit/s) the
members' leader accepted its request, which completed the roster, and began at once, while the
newcomer gave up after 1 s; the group then waited for a member that never started, and no
member landed the round. Members keep the short wait (it breaks two peers asking each other
at once; a newcomer's search lasts phases, not seconds)."""


@dataclass(frozen=True)
class _Reading:
    """A read of the digest records under way, with the run's members beside it (gated runs)."""

    started: float
    records: Callable[[], list[DigestRecord]]
    members: Callable[[], None] | None

    def finish(self) -> list[DigestRecord]:
        if self.members is not None:
            self.members()
        return self.records()


class _ExpectedRoundFailures(logging.Filter):
    """hivemind's averager logs a step that failed the way rounds may fail (no group formed, a
    member gone mid all-reduce) at ERROR with a full traceback, and also hands the error to the
    step's future, which ``PendingRound.result`` logs as one WARNING line. Unless hivemind logs
    at DEBUG, drop its copy: a volunteer should not see a traceback for a round that degraded
    as designed. Unexpected errors keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (AllreduceException, MatchmakingException)):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_QUIET = _ExpectedRoundFailures()


def quiet_expected_round_failures() -> None:
    """Install the filter on hivemind's averager logger (before the averager process forks)."""
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    if _QUIET not in averager_logger.filters:
        averager_logger.addFilter(_QUIET)


@dataclass
class PendingRound:
    control: StepControl
    averager: ExactAverager
    started: float
    meets: int
    round_: int = -1
    """The round this peer stated (its fragments' gates are keyed by it)."""

    def done(self) -> bool:
        return self.control.done()

    def open_fragment(self, index: int) -> FragmentAnswer:
        """Fragment ``index`` is in the averager's buffer (``ExactAverager.open_fragment``)."""
        return self.averager.open_fragment(self.round_, index)

    def wait(self, timeout: float) -> bool:
        try:
            self.control.result(timeout=timeout)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - it ended (``result`` says how)
            return True
        return True

    def abandon(self) -> bool:
        """End the step while it is still matchmaking (``ExactAverager.abandon_search``: a leader
        disbands its followers, who look on). Once its all-reduce has begun it is left alone: it
        may be a member the group needs."""
        if self.control.done() or self.control.began_allreduce:
            return False
        return self.averager.abandon_search()

    def result(self) -> RoundResult | None:
        """Block until the round ends; None if it failed before a group formed (no group, a
        timeout). A group whose all-reduce failed here gives a result with everything
        ``missing`` (its members may land the round without this peer)."""
        try:
            outcome = self.control.result()
        except Exception as exc:  # noqa: BLE001 - hivemind raises many kinds; the round just failed
            logger.warning("averaging round failed: %s", exc)
            return None
        if not isinstance(outcome, GroupOutcome):
            return None
        waited = time.monotonic() - self.started  # since launch
        with self.averager.get_tensors() as tensors:
            averaged = tensors[0]
        stats, gathered = outcome.stats, outcome.gathered
        if outcome.failed:
            logger.warning("averaging round failed here after its group formed: %s", outcome.failed)
        return RoundResult(
            averaged=averaged,
            group_size=len(gathered),
            members=[data for data in gathered.values() if data is not None],
            stats=stats,
            wait_s=waited,
            round_s=waited,
            offenders=offenders_by_id(stats.offences, gathered),
            receipts=by_public_id(stats.receipts, gathered),
            led=outcome.led,
        )


def lend(averager: ExactAverager) -> LentOutbox | None:
    """``averager``'s shared vector under the lock ``get_tensors`` takes, held until released;
    None if the averager holds it now (a round averages it)."""
    lock = averager.lock_averaged_tensors
    if not lock.acquire(block=False):
        return None
    released = threading.Lock()

    def release() -> None:
        if released.acquire(blocking=False):
            lock.release()

    return LentOutbox(averager.vector, release)  # (the same tensor for the averager's life)


def offenders_by_id(offences: dict[str, str], gathered: dict[str, Gathered | None]) -> dict[str, str]:
    """``offences`` (libp2p peer id → why) keyed by the public id each member gathered instead
    (its libp2p id where it gathered none)."""
    named = {}
    for peer, reason in offences.items():
        data = gathered.get(peer)
        named[data.id if data is not None and data.id else peer] = reason
    return named


def by_public_id(receipts: dict[str, bytes], gathered: dict[str, Gathered | None]) -> dict[str, bytes]:
    """``receipts`` (libp2p peer id → receipt) keyed by the public id each member gathered;
    those of members that gathered none are dropped (nobody could check them)."""
    named = {}
    for peer, receipt in receipts.items():
        data = gathered.get(peer)
        if data is not None and data.id:
            named[data.id] = receipt
    return named


async def _routing_peers(_dht: DHT, node: Any) -> list[bytes]:
    """The peers in a DHT node's routing table (run in the DHT's process)."""
    return [peer.to_bytes() for peer in node.protocol.routing_table.peer_id_to_uid]


async def _greet(peers: list[bytes], _dht: DHT, node: Any) -> int:
    """Ping each of ``peers`` from a DHT node (run in the DHT's process): how many answered."""
    answers = await asyncio.gather(*(node.protocol.call_ping(PeerID(peer)) for peer in peers), return_exceptions=True)
    answered = sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
    logger.info("swarm: %d of the %d peers the old node knew answered the new one", answered, len(peers))
    return answered


@dataclass(frozen=True)
class _Move:
    dht_kwargs: dict[str, Any]
    done: threading.Event


class Swarm:
    """DHT node + averager for one run."""

    def __init__(
        self,
        spec: RunSpec,
        numel: int,
        codec: Codec,
        *,
        initial_peers: list[str],
        host_maddrs: list[str],
        client_mode: bool = False,
        dht_kwargs: dict[str, Any] | None = None,
        gate: MemberGate | None = None,
        updates: UpdateStore | None = None,
        identity: Identity | None = None,
        bulk: BulkSettings | None = None,
        bootstrap_wait_s: float = 0.0,
        bootstrap_pause: Callable[[float], None] = time.sleep,
    ) -> None:
        """``bootstrap_wait_s``: how long to keep starting the DHT node while none of
        ``initial_peers`` answers (``engine.dht_start``), pausing with ``bootstrap_pause``
        between tries (one that a stop request ends); 0 fails at the first refusal."""
        self.spec = spec
        self._bootstrap_wait_s, self._bootstrap_pause = bootstrap_wait_s, bootstrap_pause
        self.gate = gate
        self._receipt_key = identity.to_pem() if identity is not None else None
        """The node's key, with which its reducer signs receipts (``protocol.receipts``)."""
        self.client_mode = client_mode
        self.bulk = bulk
        """Where this peer's averager takes parts over the bulk channel (``engine.bulk_channel``)."""
        self.electorate: set[str] = set()
        """Open runs: public ids of the peers this one averaged with (see ``eligible``)."""
        """Open-run newcomer: how many rounds it launched to meet a later round (``_meeting_round``)."""
        self._pace = SwarmPace()
        self._meetings = Meetings(self._pace)
        self._landed = LandingTimes()
        self._records: tuple[float, list[DigestRecord]] = (-math.inf, [])
        self._reading: _Reading | None = None
        """A read of the records begun by ``prefetch_records``, not taken yet."""
        self._reads = threading.Lock()
        self._lookup_s = 0.0
        """When this peer first saw a digest record of each round: the swarm's pace."""
        self._in_flight: PendingRound | None = None
        quiet_expected_round_failures()
        self.numel, self.codec, self.updates = numel, codec, updates
        self._initial_peers, self._host_maddrs = list(initial_peers), list(host_maddrs)
        self._identity_dir = tempfile.TemporaryDirectory(prefix="swarmtrain-p2p-")
        identity_path = Path(self._identity_dir.name) / "p2p.key"
        write_ed25519_identity(identity_path)  # hivemind would write an RSA one: engine.p2p_identity
        self._dht_kwargs: dict[str, Any] = {
            # one libp2p identity for the process's life: a move (``move_to``) restarts the
            # daemon under it, so tokens, records and other peers' routes to it stay good
            "identity_path": str(identity_path),
            "check_if_identity_free": False,
            **(dht_kwargs or {}),
        }
        self._allreduce_timeout_s: float | None = None
        self._move: _Move | None = None
        """A move asked for by ``move_to``, made at the next ``start_round``."""
        choose_kernels(self.numel)  # before the averager's process starts: it inherits the choice
        self.dht, self.averager = self._open()
        self.run_records = RunRecords(self.dht, self.averager.prefix)

    def _open(self) -> tuple[DHT, ExactAverager]:
        """This peer's DHT node (its daemon announcing ``_dht_kwargs``'s addresses) and averager."""
        spec = self.spec
        dht = start_dht(
            lambda: DHT(
                initial_peers=self._initial_peers,
                host_maddrs=self._host_maddrs,
                client_mode=self.client_mode,
                start=False,
                record_validators=[RunRecordBounds(run_prefix(spec.digest()))],
                **self._dht_kwargs,
            ),
            wait_s=self._bootstrap_wait_s,
            sleep=self._bootstrap_pause,
        )
        # rejoins the rest of the swarm through the bootstrap peers should an outage split it
        dht.run_coroutine(partial(keep_bootstrapped, list(self._initial_peers)), return_future=True)
        averaging = spec.averaging
        min_matchmaking_time, request_timeout = matchmaking_windows(averaging.matchmaking_timeout_s)
        self._request_timeout_s = self._requests_at = request_timeout
        averager = ExactAverager(
            self.numel,
            dht,
            codec=self.codec,
            prefix=run_prefix(spec.digest()),
            start=True,
            min_group_size=averaging.min_group_size,
            target_group_size=None,  # one group per round, of any size (engine.matchmaking)
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=averaging.allreduce_timeout_s,
            next_chunk_timeout=averaging.allreduce_timeout_s / 3,
            client_mode=self.client_mode,
            gate=self.gate,
            streams=averaging.streams,
            sync_fragments=averaging.fragments_in_turn,
            robust=RobustRule.for_spec(averaging, spec.credits),
            audit=averaging.audit,
            updates=self.updates,
            receipt_key=self._receipt_key,
            bulk=self.bulk,
        )
        return dht, averager

    def move_to(self, dht_kwargs: dict[str, Any]) -> threading.Event:
        """Restart the DHT node and the averager with ``dht_kwargs`` (new announced addresses: a
        relayed peer whose relays all left, ``peer.net.relay_keeper``) under the same libp2p
        identity, keeping the rosters its matchmaking remembers, at the start of the next round,
        on the trainer's thread (nothing else of the swarm is in use then); a round still
        matchmaking is given up for it. The event is set once the swarm runs again there."""
        move = _Move(dict(dht_kwargs), threading.Event())
        self._move = move
        flight = self._in_flight
        if flight is not None:  # a search nobody can answer: the round fails now, the next moves
            flight.abandon()
        return move.done

    def _make_move(self) -> None:
        move, self._move = self._move, None
        if move is None:
            return
        started = time.monotonic()
        provider = self.averager.state_provider
        rosters = self.averager.kept_rosters()  # the next round's leader asks after its roster's members
        try:
            known: list[bytes] = self.dht.run_coroutine(_routing_peers)
        except Exception as exc:  # noqa: BLE001 - the old node may be gone already: nobody to greet
            logger.debug("swarm: could not list the old node's peers: %s", exc)
            known = []
        self.averager.shutdown()
        self.dht.shutdown()
        self._dht_kwargs.update(move.dht_kwargs)
        self.dht, self.averager = self._open()
        self.run_records = RunRecords(self.dht, self.averager.prefix)
        self.averager.state_provider = provider
        self.averager.keep_rosters(rosters)
        if self._allreduce_timeout_s is not None:
            self.averager.set_allreduce_timeout(self._allreduce_timeout_s)
        self._in_flight, self._reading, self._records = None, None, (-math.inf, [])
        # others still hold the old addresses: a connection from the new daemon to each peer the
        # old node knew tells it the new ones (libp2p's identify), and finds theirs
        self.dht.run_coroutine(partial(_greet, known), return_future=True)
        logger.info("swarm: moved to %s in %.1f s", self.visible_maddrs, time.monotonic() - started)
        move.done.set()

    @property
    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    @contextmanager
    def outbox(self) -> Iterator[torch.Tensor]:
        """The averager's shared vector (``SwarmPort.outbox``), locked while the caller holds it."""
        with self.averager.get_tensors() as tensors:
            yield tensors[0]

    def lend_outbox(self) -> LentOutbox | None:
        """The averager's shared vector (``SwarmPort.lend_outbox``; ``lend``)."""
        return lend(self.averager)

    def fragment_buffer(self) -> torch.Tensor:
        """The averager's buffer of fragments in turn (``SwarmPort.fragment_buffer``): its shared
        vector, whose use the gates order (``engine.sync_gates``), not its lock."""
        return self.averager.vector

    def set_sync_span(self, span_s: float) -> None:
        self.averager.set_sync_span(span_s)

    def start_round(
        self,
        *,
        weight: float,
        gather: Gathered,
        timeout: float | None = None,
        window: float | None = None,
        joining: bool = False,
    ) -> PendingRound:
        """Start averaging the outbox's vector with whoever is looking within ``timeout`` s (see
        ``SwarmPort.start_round``)."""
        if self._move is not None and not self.averaging():
            self._make_move()
        requests = self._request_timeout_s * (JOINING_REQUEST_FACTOR if joining else 1.0)
        if requests != self._requests_at:
            self.averager.set_request_timeout(requests)
            self._requests_at = requests
        timeout = timeout or self.spec.averaging.matchmaking_timeout_s
        window = min(window, matchmaking_window(timeout)) if window else matchmaking_window(timeout)
        if self.client_mode:
            # it cannot lead: when it launched first, its group's leader may launch up to a
            # timeout later and close a window after that (it waits for them all the same)
            timeout += window
        meet = self._meeting_round(gather.round, window)
        control = self.averager.step(
            gather=replace(gather, meet=meet).to_wire(),
            weight=max(weight, NEGLIGIBLE_WEIGHT),
            scheduled_time=get_dht_time() + window,
            timeout=timeout,
            wait=False,
        )
        meets = meet if meet is not None else -1  # (a gather without a round meets none)
        pending = PendingRound(
            control=control,
            averager=self.averager,
            started=time.monotonic(),
            meets=meets,
            round_=gather.round if gather.round is not None else -1,
        )
        self._in_flight = pending
        return pending

    def averaging(self) -> bool:
        """Whether this peer's latest round is still matchmaking or averaging."""
        return self._in_flight is not None and not self._in_flight.done()

    def _meeting_round(self, round_: int | None, window: float = 0.0) -> int | None:
        """The round whose DHT key this peer's group meets at (``ExactAverager._step``): its own,
        except for a newcomer to an open run, whose electorate is empty so it sees no agreed
        state to adopt: it meets a later round the DHT shows, so that its first group (where it
        is stale, weight 0) is the evidence it re-syncs from (docs/design/records.md, "Open runs").
        It meets the round *after* one the records show (the swarm launches that one within
        about a phase, and the newcomer, declared first, leads it; the round shown may already
        be launched), trying each in turn (``peer.swarm.meeting.Meetings``). ``window``: how long
        this peer, leading the round it meets, waits for the swarm to arrive."""
        if round_ is None:
            return None
        return self._meetings.choose(round_, lambda: self._meeting_candidates(round_, window))

    def _meeting_candidates(self, round_: int, window: float = 0.0) -> list[Meeting]:
        """An open-run newcomer's rounds to meet at (later than ``round_``; none otherwise)."""
        if self.gate is not None or self.electorate:
            return []
        return meeting_candidates(self.records(), round_, window, self._pace)

    def behind(self, round_: int) -> bool:
        """Whether this peer meets a later round than its own (``_meeting_round``): a newcomer
        to an open run, whose first group will weigh it 0 whatever it trains."""
        return bool(self._meeting_candidates(round_))

    def publish_digest(
        self,
        identity: Identity,
        *,
        round_: int,
        digest: str,
        roster: int = 0,
        leaving: bool = False,
        landed: float | None = None,
    ) -> None:
        """Sign and store this peer's post-round digest (and the state's roster size as this
        peer knows it, and when it landed the state by averaging, DHT time) in the DHT (does not
        block); ``leaving``: marked as its last, stored before this returns (the DHT node stops
        soon after)."""
        try:
            self.run_records.publish_digest(
                identity, round_=round_, digest=digest, roster=roster, leaving=leaving, wait=leaving, landed=landed
            )
        except Exception as exc:  # noqa: BLE001 - a leave the DHT did not take: the next round waits for us
            logger.warning("could not say in the DHT that this peer leaves: %s", exc)

    def roster_of(self, digest: str, *, exclude: PublicKey | None = None) -> RosterClaim:
        """The roster size of the state ``digest`` as the eligible peers holding it published it
        (``protocol.roster.claimed_roster``; 0 if none did), and who they are: what a peer that
        adopted the state by download gathers, so that it cannot help a minority group land."""
        eligible = self.eligible()
        held = [r for r in self.records(exclude=exclude) if r.digest == digest and eligible(r.signer.id)]
        return RosterClaim(claimed_roster(r.roster for r in held if r.roster > 0), frozenset(r.signer.id for r in held))

    def records(self, *, exclude: PublicKey | None = None) -> list[DigestRecord]:
        """Valid digest records in the DHT, but ``exclude``'s (whoever signed them): a read begun
        within ``RECORDS_FRESH_S`` serves (one begun by ``prefetch_records`` is waited for)."""
        with self._reads:
            read_at, records = self._records
            if time.monotonic() - read_at >= RECORDS_FRESH_S:
                reading, self._reading = self._reading, None
                if reading is None or time.monotonic() - reading.started >= PREFETCH_FRESH_S:
                    reading = self._begin_read()
                    records = reading.finish()  # a lookup's time, which ``lookup_s`` follows
                    self._lookup_s = max(time.monotonic() - reading.started, LOOKUP_DECAY * self._lookup_s)
                else:
                    records = reading.finish()
                self._records = (reading.started, records)
                rounds = {record.round for record in records if not record.archive}
                self._pace.saw(rounds, time.monotonic(), landing_medians(records))
                self._landed.saw(records, self.eligible())
        return [r for r in records if r.signer != exclude]

    def prefetch_records(self) -> None:
        """Begin a read of the digest records (and of the run's members, in a gated run) in the
        background, unless one is under way: the next ``records`` call takes it instead of
        looking up then. A peer rolling forward reads them beside its update download, so both
        cost one lookup's time (a second on a home link), not one after the other."""
        with self._reads:
            if self._reading is None:
                self._reading = self._begin_read()

    def _begin_read(self) -> _Reading:
        gate = None if self.gate is None else self.gate.start_refresh(self.dht, max_age_s=RECORDS_FRESH_S)
        return _Reading(time.monotonic(), self.run_records.start_digest_records(), gate)

    def lookup_s(self) -> float:
        """How long a DHT lookup takes from this peer lately (its reads of the digest records:
        the slowest recent one, decaying by ``LOOKUP_DECAY`` a read); about as long as its
        declaration for a round takes to be stored where the round's leader looks."""
        return self._lookup_s

    def seen_at(self, round_: int) -> float | None:
        """When (monotonic) the swarm landed ``round_``: the median landing time its members
        signed into their records (``DigestRecord.landed``), or else when this peer first saw
        a record of it (later by its reads of the DHT, seconds on a home link); None if neither."""
        landed = self._landed.at(round_)
        if landed is not None:
            return time.monotonic() - max(0.0, get_dht_time() - landed)
        return self._pace.first_seen.get(round_)

    def eligible(self) -> Callable[[str], bool]:
        """Whose digest records count (``protocol.agreement``, rule 1): in a gated run the
        peers holding a valid token of the run's coordinator (looked up at most every
        ``RECORDS_FRESH_S``); in an open run
        the peers this one averaged with (``saw_group``)."""
        if self.gate is None:
            electorate = frozenset(self.electorate)
            return electorate.__contains__
        gate = self.gate
        gate.refresh(self.dht, max_age_s=RECORDS_FRESH_S)  # two DHT lookups: not at every call
        now = time.time()
        return lambda key: gate.is_member_key(key, now=now)

    def saw_group(self, members: list[Gathered]) -> None:
        """Remember the public ids of the members of a group this peer averaged with: in an
        open run they are the peers whose digest records count."""
        self.electorate.update(member.id for member in members if member.id)

    def accepted_state(self, *, exclude: PublicKey | None = None) -> Agreement | None:
        """The swarm's latest state by the votes of its members (but ``exclude``); None if
        they cast none or the newest round is a tie."""
        return agreed_state(record_votes(self.records(exclude=exclude)), eligible=self.eligible())

    def fallback_states(self, *, exclude: PublicKey | None = None, after_round: int = -1) -> list[Agreement]:
        """Each round's agreed state later than ``after_round``, newest first: what a peer may
        adopt when nobody serves the latest state any more (an archived checkpoint, say)."""
        states = agreed_states(record_votes(self.records(exclude=exclude)), eligible=self.eligible())
        return [state for state in states if state.round > after_round]

    def landed_beside(self, round_: int, group: frozenset[str], *, within_s: float) -> frozenset[str]:
        """Who, outside ``group`` and with a vote that counts, says it landed a round after
        ``round_`` by averaging in the last ``within_s`` seconds (``protocol.roster.landed_beside``)."""
        since = get_dht_time() - within_s
        return landed_beside(self.records(), round_=round_, group=group, eligible=self.eligible(), since=since)

    def peers_at(self, round_: int, *, exclude: PublicKey | None = None) -> set[str]:
        """Ids of the training peers (but ``exclude``) whose latest digest record is of ``round_``
        or later (a hint for waiting, not a vote: not filtered by eligibility)."""
        return {r.signer.id for r in self.records(exclude=exclude) if r.round >= round_ and not r.archive}

    def publish_membership(self, token: bytes, timeout_s: float = 30.0) -> bool:
        """Publish this peer's access token (bound to its libp2p peer id) so that the run's
        other peers let it average with them, until the token expires. Waits up to
        ``timeout_s`` for the DHT to store it (before the first round, so that nobody turns
        this peer away for a record still on its way); False, logged, if it did not."""
        decoded = decode_token(token)
        if decoded.libp2p_peer_id != str(self.dht.peer_id):
            raise ValueError(f"the token is for libp2p peer {decoded.libp2p_peer_id!r}, not {self.dht.peer_id}")
        return self.run_records.publish_token(
            token, libp2p_peer_id=decoded.libp2p_peer_id, expires_at=decoded.expires_at, timeout_s=timeout_s
        )

    def serve_state(self, provider: StateProvider) -> None:
        """Serve ``provider()``'s state to members that download it (late joiners, re-syncs)."""
        self.averager.state_provider = provider

    def download_state(
        self, accept: set[str], *, timeout: float, newer_than: int | None = None
    ) -> DownloadedState | None:
        """A state whose digest is in ``accept`` (or of a round after ``newer_than``, which the
        caller verifies itself), from an (admitted) peer that serves it."""
        return self.averager.load_verified_state(accept, timeout=timeout, newer_than=newer_than)

    def keep_update(self, round_: int, pre: str, post: str, left_out: list[tuple[int, int]]) -> None:
        """Round ``round_`` landed here from state ``pre`` to ``post``: keep its update for newcomers."""
        self.averager.keep_update(round_, pre, post, left_out)

    def download_update(self, round_: int, digest: str, *, timeout: float) -> FetchedUpdate | None:
        """The update that takes the state of ``round_`` (``digest``) one round forward, from a
        member that kept it (``timeout``: the longest a server may stay silent)."""
        return self.averager.download_update(round_, digest, timeout)

    def set_allreduce_timeout(self, timeout_s: float) -> None:
        self._allreduce_timeout_s = timeout_s
        self.averager.set_allreduce_timeout(timeout_s)

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()
        if self.updates is not None:
            self.updates.close()
        self._identity_dir.cleanup()
