"""The coordinator's logic, transport-free: admission, heartbeats, round reports, ticks.

The gRPC servicer (``coordinator.servicer``) is a thin adapter over ``Coordinator``; time is
passed in, so all of this runs in tests without sockets. State lives in three places:
``Store`` (everything that must survive a crash: run, allowlist, bans, peers, claims,
credits, rounds, swarm samples), ``HealthTracker`` (per-peer liveness, rebuilt from
heartbeats after a restart) and ``RoundBook`` (``coordinator.rounds``: the undecided claims
and the figures of the rounds reported, re-loaded from the store on start). The coordinator is never on the critical path of a training step: peers train
and average without it and re-send reports when it is back.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable

from coordinator.access import Access
from coordinator.admission import admit, parse_body
from coordinator.credit_cache import CreditCache
from coordinator.credits import OFFENCE
from coordinator.front.wire import NOT_ADMITTED
from coordinator.health import HealthConfig, HealthTracker
from coordinator.heartbeats import Heartbeats
from coordinator.limits import (
    check_hardware,
    check_heartbeat,
    check_network_path,
    check_relay_port,
    check_report,
    check_text,
)
from coordinator.progress import run_progress
from coordinator.relay_offers import relay_endpoint, volunteer_relays
from coordinator.round_view import RoundWindow
from coordinator.rounds import RoundBook
from coordinator.slots import DataSlots
from coordinator.snapshot import DataProgress, SwarmSnapshot, data_progress, rounds_per_hour
from coordinator.status_wire import status_response
from coordinator.store import RoundClaim, Store
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, MalformedMessageError
from protocol.identity import Identity, PublicKey
from protocol.messages import MessageVerifier, SignedMessage, sign_message
from protocol.modelsize import task_flops_per_sample
from protocol.spec import RunSpec
from protocol.tokens import issue_token
from relay.server import RelayStats

logger = logging.getLogger(__name__)

MAX_LOCAL_RANKS = 64
"""A node says how many local ranks it runs; more than this is not one machine."""


HISTORY_KEEP_S = 24 * 3600.0
"""Swarm samples (one a tick, ``Store.record_sample``) are kept this long: the longest window
``/api/v1/history`` serves (the dashboard's charts ask for the last hour)."""
PRUNE_EVERY_S = 300.0
"""``tick`` deletes samples older than ``history_keep_s`` at most this often."""
PENDING_REASON = "pending: waiting for the other group members' reports"
OUT_OF_SYNC_ROUNDS = 500
"""``out_of_sync`` judges peers by the agreed digests of this many newest finalized rounds."""


class Coordinator:
    """Admits peers, tracks them, verifies their claims, keeps the ledger."""

    def __init__(
        self,
        *,
        spec: RunSpec,
        spec_toml: str,
        identity: Identity,
        store: Store,
        bootstrap_maddrs: list[str],
        health: HealthConfig | None = None,
        operators: tuple[str, ...] = (),
        history_keep_s: float = HISTORY_KEEP_S,
    ) -> None:
        self.spec, self.spec_toml, self.identity, self.store = spec, spec_toml, identity, store
        self.digest = spec.digest()
        self.bootstrap_maddrs = list(bootstrap_maddrs)
        self.relay_port = 0
        """The relay's port on this host, told to joining peers (0: no relay)."""
        self.relay_stats: Callable[[], RelayStats] | None = None
        """The relay's figures now (``/metrics``); None without a relay."""
        self.health = HealthTracker(health or HealthConfig())
        self._owner_since: dict[str, float] = {}
        self.verifier = MessageVerifier()
        # the same figure the peers compute (an import task earns FLOPs only if its spec declares them)
        self.flops_per_sample = task_flops_per_sample(spec)
        first_start = store.run() is None
        store.set_run(spec_digest=self.digest, spec_toml=spec_toml, name=spec.run.name)
        if first_start:  # afterwards the live allowlist (``swarmtrain admin``) is the truth
            for allowed in spec.admission.allowlist:
                store.allow(allowed)
        else:
            missing = set(spec.admission.allowlist) - store.allowlist()
            for key in sorted(missing):
                logger.warning(
                    "%s is in the spec's allowlist but was removed live; `swarmtrain admin allow` puts it back", key
                )
        self.operators = {identity.public_key.id, *operators}
        self.access = Access(spec, store)
        """Who may take part (``coordinator.access``)."""
        self.data_slots = DataSlots(store, spec.data.slots, now=time.time()) if spec.data.source == "tokens" else None
        """Token runs: who trains which data stream (``coordinator.slots``)."""
        self.rounds = RoundBook(spec, store, flops_per_sample=self.flops_per_sample, data_slots=self.data_slots)
        """Every round report from its arrival to its decision (``coordinator.rounds``)."""
        self.credit = CreditCache()
        """Each peer's credit as its heartbeat answers it (``coordinator.credit_cache``)."""
        self.beats = Heartbeats(
            health=self.health,
            credit=self.credit,
            store=store,
            verifier=self.verifier,
            admitted=self._admitted,
            max_samples_per_second=spec.credits.max_samples_per_second,
            data_slots=self.data_slots,
        )
        """Heartbeats applied and answered, here and by the heartbeat processes (``coordinator.heartbeats``)."""
        self.heartbeat_port = 0
        """The heartbeat processes' port on this host, told to joining peers (0: none run)."""
        self.history_keep_s = history_keep_s
        self._pruned_at = -math.inf
        self.rounds.reload(restarted=time.time(), owner_of=self._owner_of)

    @property
    def round_view(self) -> RoundWindow:
        """How the newest rounds averaged (``coordinator.round_view``), as the reports say."""
        return self.rounds.view

    @property
    def data_epoch(self) -> float:
        """Token runs: the data order's position in epochs (``RoundBook.data_epoch``)."""
        return self.rounds.data_epoch

    # --- RPCs -------------------------------------------------------------------------------

    def join(self, envelope: pb.SignedEnvelope, *, now: float, source: str = "") -> pb.JoinResponse:
        """Admit a peer (``coordinator.admission``) and answer with the run, a token and the
        relays; ``source``: the host the request came from, where a relay the peer offers
        listens (a relay offered without one is not listed)."""
        admitted = admit(
            envelope,
            verifier=self.verifier,
            now=now,
            run_digest=self.digest,
            mode=self.spec.admission.mode,
            allowlist=self.access.allowed(),
            banned=set(self.access.banned()),
            source=source,
        )
        body = admitted.body
        key = admitted.peer.id
        check_text("join libp2p_peer_id", body.libp2p_peer_id)
        check_text("join software_version", body.software_version)
        check_hardware(body.hardware)
        check_network_path(body.network_path)
        check_relay_port(body.relay_port)
        self.store.upsert_peer(
            key=key,
            account_key=admitted.account.id,
            libp2p_peer_id=body.libp2p_peer_id,
            software_version=body.software_version,
            hardware_json=json.dumps(_hardware(body.hardware), sort_keys=True),
            reachable=body.reachable,
            now=now,
        )
        self.access.accounts[key] = admitted.account.id
        self.health.join(
            key,
            libp2p_peer_id=body.libp2p_peer_id,
            software_version=body.software_version,
            reachable=body.reachable,
            now=now,
            local_ranks=max(1, min(body.hardware.local_ranks, MAX_LOCAL_RANKS)),
            network_path=body.network_path,
            relay=relay_endpoint(source, body.relay_port),
        )
        data_slot = None
        if self.data_slots is not None:
            data_slot = self.data_slots.assign(key, max(1, min(body.hardware.local_ranks, MAX_LOCAL_RANKS)), now=now)
        self.beats.joined(key)
        token = issue_token(
            self.identity,
            run_digest=self.digest,
            peer_key=admitted.peer,
            now=now,
            ttl_s=self.spec.admission.token_ttl_s,
            libp2p_peer_id=body.libp2p_peer_id,
        )
        latest = self.store.rounds(limit=1)
        logger.info("admitted %s (account %s)", key, admitted.account.id)
        response = pb.JoinResponse(
            spec_toml=self.spec_toml,
            spec_digest=self.digest,
            access_token=token.to_bytes(),
            bootstrap_maddrs=self.bootstrap_maddrs,
            current_round=latest[0].round if latest else 0,
            current_state_digest=latest[0].state_digest if latest else "",
            coordinator_public_key=self.identity.public_key.raw,
            server_time=now,
            heartbeat_interval_s=self.health.config.heartbeat_interval_s,
            data_slot=data_slot,
            relay_port=self.relay_port,
            relays=volunteer_relays(self.health.relay_offers(now, exclude=key), self.access.account_of),
            heartbeat_port=self.heartbeat_port,
        )
        # signed and bound to this request: an on-path attacker can swap neither the spec nor
        # the bootstrap peers nor the relays of a peer that pinned this coordinator's key
        answer = pb.JoinAnswerBody(answer=response, request_nonce=envelope.nonce)
        signed = sign_message(self.identity, kinds.JOIN_ANSWER, answer.SerializeToString(), now=now)
        response.signed_answer.CopyFrom(signed.to_proto())
        return response

    def heartbeat(self, envelope: pb.SignedEnvelope, *, now: float) -> pb.HeartbeatResponse:
        """Safe to call beside every other method (the servicer runs heartbeats outside its
        lock, so that they never wait for a report's or a tick's database writes): it touches
        only thread-safe state (``coordinator.heartbeats``)."""
        peer, body = self._verified(envelope, kinds.HEARTBEAT, pb.HeartbeatBody, now, acts_for=self._admitted)
        check_heartbeat(body)
        interval = self.health.config.heartbeat_interval_s
        if not self._admitted(peer):
            return pb.HeartbeatResponse(
                server_time=now, heartbeat_interval_s=interval, admitted=False, message=NOT_ADMITTED
            )
        if self.beats.newer(peer.id, envelope.timestamp):
            self.beats.apply(peer.id, body, now)
        return self.beats.response(peer.id, now, interval)

    def report_round(self, envelope: pb.SignedEnvelope, *, now: float) -> pb.RoundReportResponse:
        """Verify a round report, then record it (``record_reports``); it is decided at a later
        ``tick``. The servicer does the two apart: verified outside its lock, recorded in
        batches (``coordinator.reports``)."""
        peer, body = self.verify_report(envelope, now=now)
        (outcome,) = self.record_reports([(peer.id, body, now)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def verify_report(self, envelope: pb.SignedEnvelope, *, now: float) -> tuple[PublicKey, pb.RoundReportBody]:
        """A report's signer and body, checked (signature, age, replay, bounds, admitted);
        thread-safe, like ``heartbeat``: it changes nothing but the replay guard."""
        peer, body = self._verified(envelope, kinds.ROUND_REPORT, pb.RoundReportBody, now, acts_for=self._admitted)
        check_report(body)
        if not self._admitted(peer):
            raise AdmissionError(f"{peer.id} is not admitted: join again before reporting")
        return peer, body

    def record_reports(
        self, reports: list[tuple[str, pb.RoundReportBody, float]]
    ) -> list[pb.RoundReportResponse | Exception]:
        """Record verified reports of distinct keys (``RoundBook.record_many``: one transaction);
        each one's answer, or the error that refuses it (nothing of that one changes)."""
        outcomes: list[pb.RoundReportResponse | Exception] = []
        claims: list[tuple[int, RoundClaim, pb.RoundReportBody]] = []
        keys = {key for key, _, _ in reports}
        self.rounds.prefetch_clocks(keys)
        owners = {self.access.account_of(key) for key in keys} - self._owner_since.keys()
        if owners:
            self._owner_since.update(self.store.first_seen_of_many(owners))
        for key, body, now in reports:
            try:
                if not self._admitted(PublicKey.from_id(key)):  # banned or dropped since it was verified
                    raise AdmissionError(f"{key} is not admitted: join again before reporting")
                account, owner_since = self._owner_of(key)
                claim = self.rounds.claim_of(key, body, now=now, account=account, owner_since=owner_since)
            except (AdmissionError, MalformedMessageError, ValueError) as exc:
                outcomes.append(exc)
                continue
            if self.rounds.already_reported(key, body.round):  # a resent report (the store refuses it too)
                outcomes.append(pb.RoundReportResponse(status=pb.CLAIM_STATUS_PENDING, reason="already reported"))
                continue
            outcomes.append(pb.RoundReportResponse(status=pb.CLAIM_STATUS_PENDING, reason=PENDING_REASON))
            claims.append((len(outcomes) - 1, claim, body))
        recorded = self.rounds.record_many([(claim, body) for _, claim, body in claims])
        for (index, claim, body), result in zip(claims, recorded, strict=True):
            if isinstance(result, Exception):
                outcomes[index] = result
            elif not result:
                outcomes[index] = pb.RoundReportResponse(status=pb.CLAIM_STATUS_PENDING, reason="already reported")
            else:
                self.credit.moved(claim.key, pending=body.samples)
                self.health.record_report(
                    claim.key,
                    allreduce_s=body.allreduce_s,
                    bytes_sent=body.bytes_sent,
                    bytes_received=body.bytes_received,
                )
        return outcomes

    def snapshot(self, *, now: float) -> SwarmSnapshot:
        """The swarm at ``now``: what every status view shows (``coordinator.snapshot``)."""
        summary = self.health.summary(now)
        rounds = self.store.rounds(limit=50)
        pace = rounds_per_hour(rounds, now) if summary.peers_online else 0.0
        granted = self.store.granted_samples()
        progress = run_progress(
            self.spec,
            current_round=rounds[0].round if rounds else 0,
            granted_samples=granted,
            samples_per_second=summary.samples_per_second,
            rounds_per_hour=pace,
        )
        return SwarmSnapshot(
            at=now,
            run_name=self.spec.run.name,
            spec_digest=self.digest,
            latest=rounds[0] if rounds else None,
            evaluated=self.store.latest_validation(),
            peers_online=summary.peers_online,
            samples_per_second=summary.samples_per_second,
            rounds_per_hour=pace,
            data=self.data_progress(granted),
            rounds=self.round_view.figures(),
            peers=self.health.peers(),
            progress=progress,
        )

    def status(self, *, now: float) -> pb.StatusResponse:
        """The swarm's status as the gRPC ``Status`` call answers it (``coordinator.status_wire``)."""
        return status_response(self.snapshot(now=now))

    # --- time -------------------------------------------------------------------------------

    def tick(self, *, now: float) -> None:
        """Advance health, decide complete rounds (``RoundBook.decide``: decisions and round
        records committed), persist the swarm's figures (and, every ``PRUNE_EVERY_S``, drop
        those older than ``history_keep_s``)."""
        self.health.tick(now)
        for decided in self.rounds.decide(now, self._member_of):  # committed: health and heartbeats follow
            self.health.record_claim(decided.key, offence=not decided.granted and OFFENCE in decided.reason)
            self.credit.moved(
                decided.key, pending=-decided.claimed_samples, samples=decided.granted_samples, flops=decided.flops
            )
        summary = self.health.summary(now)
        self.store.record_sample(
            now=now,
            peers_online=summary.peers_online,
            samples_per_second=summary.samples_per_second,
            rounds_failed=self.health.rounds_failed_total(),
        )
        if now - self._pruned_at >= PRUNE_EVERY_S:
            self.store.prune_samples(before=now - self.history_keep_s)
            self._pruned_at = now

    def data_progress(self, granted: int | None = None) -> DataProgress | None:
        """Token runs: how far the run is through its data (``coordinator.snapshot.data_progress``;
        ``granted``: the samples trained, by default the ledger's); None otherwise."""
        if self.data_slots is None:
            return None
        granted = self.store.granted_samples() if granted is None else granted
        return data_progress(self.spec, granted, epoch=self.data_epoch, slots_held=len(self.data_slots.holders()))

    def out_of_sync(self, now: float) -> list[str]:
        """Keys of the online peers out of sync at ``now``: those whose latest heartbeat names
        a state (round and digest) of a round the coordinator finalized with an agreed digest
        (``Store.rounds``, one of the newest ``OUT_OF_SYNC_ROUNDS``), and another digest than
        that one. A peer at a round not finalized yet, or one that ended in a tie, is not
        judged. A peer says its state after each round it completes, so one that re-synced
        since counts until its next round lands."""
        peers = [p for p in self.health.online(now) if p.state_digest]
        if not peers:
            return []
        agreed = {r.round: r.state_digest for r in self.store.rounds(limit=OUT_OF_SYNC_ROUNDS) if r.state_digest}
        return [p.key for p in peers if agreed.get(p.round, p.state_digest) != p.state_digest]

    # --- helpers ----------------------------------------------------------------------------

    def _verified(  # type: ignore[no-untyped-def]
        self,
        envelope: pb.SignedEnvelope,
        kind: str,
        body_type: type,
        now: float,
        *,
        acts_for: Callable[[PublicKey], bool],
    ):
        """The signer and parsed body of ``envelope``, verified; its nonce is recorded only if
        ``acts_for(signer)`` (an admitted peer, an operator): a stranger's message, which
        changes nothing, takes no slot of the replay guard."""
        message = SignedMessage.from_proto(envelope)
        self.verifier.verify(message, now=now, kind=kind, record=False)
        body = parse_body(body_type, message.body, kind)
        if acts_for(message.signer):
            self.verifier.record(message, now=now)
        return message.signer, body

    def _owner_of(self, key: str) -> tuple[str, float]:
        """The account ``key`` earns for and when that account was first seen."""
        account = self.access.account_of(key)
        return account, self._first_seen_of(account)

    def _member_of(self, key: str, round_: int) -> tuple[str, float] | None:
        """``_owner_of(key)`` for a key the run admitted once and has not revoked, without a
        claim for ``round_`` in the store; else None (``RoundLedger``'s credit in absentia: a
        name in a claim is no admission, and a claim decided before a restart stands)."""
        if (
            self.store.peer(key) is None
            or key in self.revoked_peers()
            or self.store.claims(key=key, round=round_, limit=1)
        ):
            return None
        return self._owner_of(key)

    def _first_seen_of(self, owner: str) -> float:
        """When the coordinator first saw ``owner`` (an account: its earliest node key; a key
        without an account: itself), from the store; cached (it only moves earlier when an
        account's first key is stored, which happens before its first claim)."""
        cached = self._owner_since.get(owner)
        if cached is None:
            cached = self.store.first_seen(owner)
            if cached is not None:
                self._owner_since[owner] = cached
        return cached if cached is not None else math.inf

    def credits_changed(self, key: str | None = None) -> None:
        """Forget the cached credit of ``key`` (of everyone: None): whatever writes claims or
        credits behind the core's back must call it (the core itself moves the cached figures,
        ``CreditCache.moved``)."""
        self.credit.forget(key)

    def _admitted(self, peer: PublicKey) -> bool:
        """Permitted by the access rules, and joined (the health tracker knows it)."""
        return self.access.permits(peer) and self.health.get(peer.id) is not None

    def revoked_peers(self) -> set[str]:
        """Keys of the peers whose tokens must stop counting in averaging (``Access.revoked``)."""
        return self.access.revoked()

    def ban(self, key: str, reason: str, *, now: float) -> None:
        """Ban a peer or an account at once: its heartbeats and reports are refused from now on."""
        self.store.ban(key, reason, now)
        self.access.changed()
        self._drop_peers_of(key)

    def admin(self, envelope: pb.SignedEnvelope, *, now: float) -> pb.AdminResponse:
        """An operator's signed allowlist or ban change (or a listing); effective at once."""
        signer, body = self._verified(
            envelope, kinds.ADMIN, pb.AdminBody, now, acts_for=lambda key: key.id in self.operators
        )
        if signer.id not in self.operators:
            raise AdmissionError(f"{signer.id} is not an operator of this coordinator")
        message = self.access.apply(body, now=now, drop=self._drop_peers_of)
        if message:
            logger.warning("operator %s: %s", signer.id, message)
        return pb.AdminResponse(
            message=message,
            admission_mode=self.spec.admission.mode,
            allowlist=sorted(self.store.allowlist()),
            bans=[pb.BanEntry(key=b.key, reason=b.reason, banned_at=b.banned_at) for b in self.store.bans()],
        )

    def _drop_peers_of(self, key: str) -> int:
        """Forget the peers that are ``key`` or earn for account ``key``; they must join again."""
        dropped = 0
        for peer in self.access.peers_of(key):
            if self.health.get(peer) is not None:
                dropped += 1
            self.health.remove(peer)
            self.beats.dropped(peer)
        return dropped


def _hardware(hw: pb.Hardware) -> dict:
    return {
        "device": hw.device,
        "accelerator_count": hw.accelerator_count,
        "accelerator_name": hw.accelerator_name,
        "accelerator_memory_gib": hw.accelerator_memory_gib,
        "cpu_count": hw.cpu_count,
        "ram_gib": hw.ram_gib,
        "local_ranks": max(1, min(hw.local_ranks, MAX_LOCAL_RANKS)),
    }
