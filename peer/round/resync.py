"""Re-sync: how a peer whose state is not the swarm's finds the swarm's (docs/design/joining.md).

A part of the round with no state of its own beyond what it measures: it reads the swarm
through ``SwarmPort`` and returns what it found (``Found``, ``Rolled``); the trainer adopts a
state, publishes, or stops. In order of cost: the peer's own state is the swarm's; rolled
forward by the averaged updates members keep for the rounds it missed; a verified download of
the swarm's state, rolled forward to the swarm's latest; the newest older state anyone still
serves (the coordinator's archive). The records decide which state is the swarm's
(``protocol.agreement``), never the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.compression import Codec
from peer.node.schedule import outer_lr
from peer.round.host_passes import roll_forward
from peer.round.progress import ProgressSink
from peer.round.state import GlobalState
from peer.round.swarm_port import SwarmPort
from protocol.errors import MalformedTensorError
from protocol.gathered import MAX_LINK, MIN_LINK
from protocol.identity import PublicKey
from protocol.spec import OuterSection, RunSpec
from protocol.updates import FetchedUpdate

logger = logging.getLogger(__name__)

RETRY_S = 1.0
"""The pause between two looks at the swarm while a re-sync finds nothing to take."""


def outer_at(spec: RunSpec, round_: int) -> OuterSection:
    """The outer step's settings for ``round_`` (the outer learning rate's schedule applied)."""
    if spec.schedule.outer:
        return spec.outer.model_copy(update={"lr": outer_lr(spec, round_)})
    return spec.outer


@dataclass(frozen=True)
class Rolled:
    """A state rolled forward to the swarm's latest agreed state."""

    state: GlobalState
    through: tuple[tuple[int, str], ...] = ()
    """(round, digest) of every state the roll passed through, each checked, the last against
    the records: the swarm's states too (a report left unfinished for one goes with its digest)."""


@dataclass(frozen=True)
class Found:
    """What a re-sync found: the peer's own state is the swarm's (``held``), a state to adopt
    (``adopt``, its digest among ``accepted``), the run's end without this peer (``ended``: its
    last round), or nothing in time (all empty)."""

    held: bool = False
    adopt: Rolled | None = None
    accepted: frozenset[str] = frozenset()
    ended: int | None = None


class Resync:
    """Finds the swarm's state for a peer (``catch_up``), rolls a state forward by the kept
    updates (``roll_forward``), and waits for a group's first members (``wait_for_group``).
    ``link``: the bytes a second its last state download carried (waits included), which the
    peer states to its groups (``Gathered.link``); None until one is measured. ``codec``: the
    peer's codec when asked (the trainer's, which a benchmark may swap)."""

    def __init__(
        self,
        spec: RunSpec,
        swarm: SwarmPort,
        me: PublicKey,
        codec: Callable[[], Codec],
        stop: threading.Event,
        progress: ProgressSink,
    ) -> None:
        self.spec, self.swarm, self.me, self.codec = spec, swarm, me, codec
        self.stop, self.progress = stop, progress
        self.link: float | None = None

    def wait_for_group(self, round_: int, wait_s: float) -> bool:
        """Wait (up to ``wait_s``) until ``min_group_size`` peers, this one included, published a
        digest for ``round_``. True if they did."""
        needed = self.spec.averaging.min_group_size
        deadline = time.monotonic() + wait_s
        seen = -1
        while not self.stop.is_set():
            others = self.swarm.peers_at(round_, exclude=self.me)
            if len(others) + 1 >= needed:
                return True
            if len(others) != seen:
                seen = len(others)
                logger.info("waiting for the group: %d of %d peers in the swarm", seen + 1, needed)
            if time.monotonic() >= deadline:
                logger.warning("starting with %d of %d peers; the first rounds may train alone", seen + 1, needed)
                return False
            self.stop.wait(0.5)
        return False

    def catch_up(self, state: GlobalState, in_sync: bool) -> Found:
        """The swarm's latest state for a peer holding ``state`` (``in_sync``: it was the swarm's
        when last checked): download it from a peer, verified against the digest the run's
        *other* members agree on (``protocol.agreement``). Tries for a matchmaking and an
        all-reduce timeout, again after each download the swarm moved past."""
        averaging = self.spec.averaging
        deadline = time.monotonic() + averaging.matchmaking_timeout_s + averaging.allreduce_timeout_s
        while not self.stop.is_set():
            agreed = self.swarm.accepted_state(exclude=self.me)
            if agreed is not None and agreed.digest == state.digest():
                return Found(held=True)
            if agreed is not None and agreed.round > state.round:
                rolled = self.roll_forward(state.clone(), None, verified=None)
                if rolled is not None and rolled.state.round != state.round:
                    return Found(adopt=rolled, accepted=frozenset({rolled.state.digest()}))
            if agreed is not None and agreed.round >= state.round:
                timeout = averaging.allreduce_timeout_s
                started = time.monotonic()
                size_mb = 8 * state.params.numel() / 1e6
                self.progress.joining(f"downloading the swarm's state of round {agreed.round} ({size_mb:.0f} MB)")
                logger.info("downloading the swarm's state of round %d (%.1f MB)", agreed.round, size_mb)
                # a member that landed a round since the records were read serves a newer state:
                # taken too, and held to the records once they show it (``roll_forward``)
                downloaded = self.swarm.download_state({agreed.digest}, timeout=timeout, newer_than=agreed.round)
                if downloaded is not None:
                    round_, params, momentum = downloaded
                    took = time.monotonic() - started
                    logger.info("downloaded the state of round %d in %.1f s", round_, took)
                    self.link = max(MIN_LINK, min(MAX_LINK, (params.numel() + momentum.numel()) * 4 / max(took, 1e-3)))
                    fetched = GlobalState(params.clone(), momentum.clone(), round_)
                    verified = agreed.digest if round_ == agreed.round else None
                    rolled = self.roll_forward(fetched, time.monotonic() - started, verified=verified)
                    if rolled is not None:
                        return Found(adopt=rolled, accepted=frozenset({rolled.state.digest()}))
                    # the swarm moved on past what members keep: try again with a newer state
                    deadline = time.monotonic() + averaging.matchmaking_timeout_s + averaging.allreduce_timeout_s
                    time.sleep(RETRY_S)
                    continue
                if self._run_ended(agreed.round, state.round):
                    return Found(ended=agreed.round)
                # nobody serves the latest state: take the newest one somebody still serves
                # (the coordinator's archive, or a peer a round behind), if newer than ours
                older = self._fallback(agreed.round, state.round, timeout)
                if older is not None:
                    return older
            elif in_sync:
                return Found(held=True)  # no member has anything newer than we do
            if time.monotonic() > deadline:
                logger.warning("could not get the swarm's latest state; training on out of sync")
                return Found()
            time.sleep(RETRY_S)
        return Found()

    def _run_ended(self, latest: int, own: int) -> bool:
        """Whether the swarm's latest agreed round is the run's last (``rounds.max_rounds``) and
        its state could not be had: the others landed it and left. An older state would only
        have this peer train rounds alone that nobody averages any more, so it stops."""
        final = self.spec.rounds.max_rounds
        if final is None or latest < final:
            return False
        logger.warning(
            "the run ended at round %d without this peer (it missed the last round, and nobody serves its state"
            " any more); stopping at round %d",
            latest,
            own,
        )
        return True

    def _fallback(self, latest: int, own: int, timeout: float) -> Found | None:
        """The newest agreed state older than ``latest`` and newer than ``own`` that somebody serves."""
        for older in self.swarm.fallback_states(exclude=self.me, after_round=own):
            if older.round == latest:
                continue  # just tried
            downloaded = self.swarm.download_state({older.digest}, timeout=timeout)
            if downloaded is not None:
                logger.warning("nobody serves round %d's state; took round %d's", latest, older.round)
                round_, params, momentum = downloaded
                taken = GlobalState(params.clone(), momentum.clone(), round_)
                return Found(adopt=Rolled(taken), accepted=frozenset({older.digest}))
        return None

    @torch.no_grad()
    def roll_forward(
        self, state: GlobalState, download_s: float | None, *, verified: str | None, first: FetchedUpdate | None = None
    ) -> Rolled | None:
        """``state`` taken forward by the rounds the swarm landed since (``peer.round.host_passes.roll_forward``,
        by the averaged updates its members keep: ``engine.update_store``) until it is the
        swarm's latest agreed state: then returned. ``verified``: its digest, if the records
        agreed on it already (a state downloaded by that digest); a state newer than the records
        (its server landed a round since they were read) is returned once they agree on it.
        None when it could not be made the swarm's: no member keeps a round's update any more,
        one does not decode or does not make the state its server claims, the chain ends off
        the swarm's state, or the records never agree on it; the caller downloads a newer
        state. A peer whose download outlasts rounds thus gets in after its download plus the
        updates', which are a few times smaller than a state and are what its all-reduce would
        receive each round anyway. ``first``: an update already downloaded for ``state``."""
        digest = state.digest()
        rolled, update_bytes, started = 0, 0, time.monotonic()
        through = [(state.round, digest)]
        patience = time.monotonic() + self.spec.averaging.matchmaking_timeout_s
        timeout = self.spec.averaging.allreduce_timeout_s
        target = -1  # the round the records agreed on when last read
        while not self.stop.is_set():
            # every update members keep from here on (chains, one request each), then the records,
            # read beside the download (each costs a lookup's time: a second on a home link)
            self.swarm.prefetch_records()
            while (update := first or self.swarm.download_update(state.round, digest, timeout=timeout)) is not None:
                first = None
                if not rolled:
                    done = "" if download_s is None else f"state downloaded in {download_s:.0f} s; "
                    self.progress.joining(f"{done}rolling forward by the rounds' updates")
                try:
                    roll_forward(state, update, outer_at(self.spec, update.round), self.codec())
                except MalformedTensorError as exc:
                    logger.warning("round %d's update from %s does not decode (%s)", update.round, update.server, exc)
                    return None
                digest = state.digest()
                if digest != update.post:
                    logger.warning(
                        "round %d's update from %s does not make the state it claims", update.round, update.server
                    )
                    return None
                rolled, update_bytes = rolled + 1, update_bytes + update.size
                through.append((state.round, digest))
                patience = time.monotonic() + self.spec.averaging.matchmaking_timeout_s
            if state.round < target and time.monotonic() <= patience:
                # the records showed later rounds: their updates are being kept; asking again is a
                # round trip, reading the records again a DHT lookup (a second on a home link)
                time.sleep(0.25)
                continue
            read = time.monotonic()
            agreed = self.swarm.accepted_state(exclude=self.me)
            target = -1 if agreed is None else agreed.round
            logger.debug(
                "rolling forward at round %d: the records agree on round %s (read in %.2f s)",
                state.round,
                None if agreed is None else agreed.round,
                time.monotonic() - read,
            )
            if agreed is not None and agreed.round == state.round:
                if agreed.digest != digest:
                    return None
                if rolled:
                    logger.info(
                        "rolled the downloaded state forward by %d rounds to round %d (%.1f MB of updates in %.1f s)",
                        rolled,
                        state.round,
                        update_bytes / 1e6,
                        time.monotonic() - started,
                    )
                return Rolled(state, tuple(through))  # verified: the chain ends at the agreed state
            if agreed is None and verified == digest:
                return Rolled(state)  # as downloaded; the records have expired meanwhile
            if agreed is not None and agreed.round > state.round and download_s is None and not rolled:
                return None  # this peer's own state, and no member keeps the rounds it missed
            if time.monotonic() > patience:
                if agreed is not None and agreed.round > state.round:
                    logger.warning("no member keeps round %d's update: downloading a newer state", state.round)
                else:
                    logger.warning("the records never agreed on the state of round %d", state.round)
                return None
            time.sleep(0.5)  # the records lag the member that served it, or its next update is being kept
        return None
