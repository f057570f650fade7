"""The peer's running link to its coordinator: heartbeats, round reports, re-joins.

``CoordinatorLink`` runs in a background thread; nothing here blocks training. A heartbeat goes
every interval the coordinator set (the first at once): it carries the trainer's figures, brings
back the peer's credit, and is how the peer learns it must join again (the coordinator
restarted) or renew its token. A round report goes as soon as the trainer records the round
(after a random 0 to ``REPORT_SPREAD_S``), not at the next heartbeat: a peer killed seconds
after its round landed has said it by then.
What the coordinator did not take yet waits in the ``ReportOutbox`` (on disk under the
checkpoint directory: a peer killed before the answer sends it when it starts again) and goes
again after each heartbeat the coordinator answers; a report the coordinator refuses for good is
dropped, logged.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from peer.link.coordinator_client import (
    RPC_TIMEOUT_S,
    CoordinatorClient,
    CoordinatorUnavailableError,
    JoinAs,
    RejectedError,
)
from peer.link.report_outbox import ReportOutbox
from peer.link.report_wire import report_body
from peer.round.progress import Credit
from peer.round.round_metrics import RoundMetrics
from protocol import coordinator_pb2 as pb
from protocol.errors import AdmissionError, SwarmtrainError, WrongRunError
from protocol.tokens import decode_token

__all__ = ["CoordinatorLink"]

logger = logging.getLogger(__name__)

REPORT_SPREAD_S = 1.0
"""A report waits a random 0 to this many seconds before it goes: a round's members land within
a moment of each other, and thousands of reports in the same millisecond would queue at the
coordinator behind one another (the outbox keeps a report on disk meanwhile)."""


class CoordinatorLink(threading.Thread):
    """Heartbeats and round reports in the background; re-joins when told to (module doc)."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        interval_s: float,
        rejoin: JoinAs,
        on_refused: Callable[[str], None] | None = None,
        token: bytes = b"",
        on_token: Callable[[bytes], object] | None = None,
        data_slot: int | None = None,
        outbox: ReportOutbox | None = None,
    ) -> None:
        super().__init__(daemon=True, name="coordinator-link")
        self.client, self.interval_s, self.rejoin = client, interval_s, rejoin
        self.data_slot = data_slot
        """Token runs: the first data stream this peer trains; losing it stops the peer."""
        self.on_refused = on_refused or (lambda reason: None)
        """Called once the coordinator refuses this peer (banned, or off the allowlist)."""
        self.on_token = on_token or (lambda token: None)
        """Called with each new access token (re-joins; renewal at half its lifetime)."""
        self._renew_at = _renewal_time(token) if token else float("inf")
        self.refused = ""
        self.outbox = outbox if outbox is not None else ReportOutbox()
        """Reports the coordinator has not answered yet, oldest first."""
        self.status = pb.HeartbeatBody(phase=pb.PEER_PHASE_JOINING)
        self.stopping = threading.Event()
        self.connected = False
        """Whether the coordinator answered this peer's latest heartbeat (reports go at once then)."""
        self.credit: Credit | None = None
        """This peer's credit as the coordinator's last heartbeat answer had it."""
        self.rounds_failed = 0
        """Rounds whose averaging failed since this peer started (metrics rows with
        ``averaged`` false), said in every heartbeat."""
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        """Set by a new report (and by ``stop``): the thread sends before the next heartbeat."""
        self._next_beat = 0.0
        """When (monotonic) the next heartbeat is due."""
        self.phase_of: Callable[[], str] = lambda: "training"
        """The trainer's phase (``peer.round.trainer.Phase`` value), read at each heartbeat."""
        self.punched_peers: Callable[[], int] = lambda: 0
        """Peers reached over a hole-punched connection now (``peer.net.hole_punch.DirectPaths``)."""

    def report(self, metrics: RoundMetrics) -> None:
        """Keep the report of a round the trainer recorded and wake the thread to send it;
        update the heartbeat figures (a failed round is not reported: it counts in the
        heartbeats' ``rounds_failed``)."""
        if not metrics.averaged:
            self.rounds_failed += 1
        self.status = pb.HeartbeatBody(
            round=metrics.round,
            phase=pb.PEER_PHASE_TRAINING,
            samples_per_second=metrics.samples / max(metrics.wall_s, 1e-9),
            samples_total=self.status.samples_total + metrics.samples,
            loss=metrics.loss,
            state_digest=metrics.state_digest,
            rounds_failed=self.rounds_failed,
        )
        if metrics.averaged:
            try:
                self.outbox.put(report_body(metrics))
            except OSError as exc:  # a full disk costs this round's credit, never the training
                logger.error("could not keep the report of round %d: %s", metrics.round, exc)
                return
            self._wake.set()

    def landing(self, metrics: RoundMetrics, pre: str) -> None:
        """The round ``metrics`` describes averaged and begins to land: keep its report without
        the digest (``ReportOutbox.start``; ``pre``: the digest of the state it started from),
        for a restarted peer to finish should this one be killed before the round is recorded."""
        try:
            self.outbox.start(report_body(metrics), pre)
        except OSError as exc:
            logger.error("could not keep the report of round %d while it lands: %s", metrics.round, exc)

    def unfinished(self) -> list[tuple[int, str]]:
        """The rounds a previous run of this peer was landing when it stopped, each with the
        digest of the state it started from (``ReportOutbox.unfinished``)."""
        return self.outbox.unfinished()

    def holds(self, round_: int, digest: str) -> None:
        """This peer holds the state of ``round_``: a report its previous run left unfinished for
        that round goes now (``ReportOutbox.holds``)."""
        try:
            finished = self.outbox.holds(round_, digest)
        except OSError as exc:
            logger.error("could not finish the report of round %d: %s", round_, exc)
            return
        if finished:
            self._wake.set()

    def heartbeat_body(self) -> pb.HeartbeatBody:
        """The next heartbeat: the last round's figures and the trainer's phase now."""
        body = pb.HeartbeatBody()
        body.CopyFrom(self.status)
        body.punched_peers = self.punched_peers()
        if body.phase in (pb.PEER_PHASE_TRAINING, pb.PEER_PHASE_AVERAGING):
            averaging = self.phase_of() == "averaging"
            body.phase = pb.PEER_PHASE_AVERAGING if averaging else pb.PEER_PHASE_TRAINING
        return body

    def run(self) -> None:
        self._next_beat = time.monotonic()
        while not self.stopping.is_set():
            wait = self._next_beat - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                if self.stopping.is_set():
                    return
                if time.monotonic() < self._next_beat:  # woken by a report
                    if self.connected and not self.stopping.wait(random.uniform(0.0, REPORT_SPREAD_S)):
                        self._send_reports()
                    continue
            self._next_beat = time.monotonic() + self.interval_s
            self._beat()

    def _beat(self) -> None:
        """One heartbeat, what its answer calls for, then the reports waiting."""
        try:
            response = self.client.heartbeat(self.heartbeat_body())
            self._note_credit(response)
            if response.admitted:
                self._check_data_slot(response.data_slot if response.HasField("data_slot") else None)
            if not response.admitted:
                logger.info("coordinator: %s", response.message)
                self._rejoin()
            elif time.time() >= self._renew_at:
                logger.info("renewing the access token")
                self._rejoin()
            self.connected = True
            self._flush_reports(until=self._next_beat)
        except (AdmissionError, WrongRunError) as exc:
            logger.error("the coordinator refused this peer: %s", exc)
            self.connected = False
            if not self.refused:
                self.refused = str(exc)
                self.on_refused(self.refused)
        except SwarmtrainError as exc:
            self.connected = False  # reports wait for the next heartbeat the coordinator answers
            logger.warning("coordinator unreachable (training goes on): %s", exc)

    def _send_reports(self) -> None:
        """Send the waiting reports between heartbeats; an unreachable coordinator leaves them
        for the next heartbeat, and one that no longer knows this peer (it restarted) brings
        the heartbeat forward (it joins again first)."""
        try:
            self._flush_reports(until=self._next_beat)
        except CoordinatorUnavailableError as exc:
            self.connected = False
            logger.info("coordinator unreachable: the reports wait for the next heartbeat (%s)", exc)
        except (AdmissionError, WrongRunError) as exc:
            logger.info("the coordinator did not take a report (%s): a heartbeat now", exc)
            self._next_beat = time.monotonic()
        except SwarmtrainError as exc:
            logger.warning("could not send a report (it waits for the next heartbeat): %s", exc)

    def _note_credit(self, response: pb.HeartbeatResponse) -> None:
        if response.admitted and response.HasField("credited_samples"):
            self.credit = Credit(response.credited_samples, response.credited_flops, response.pending_samples)

    def _check_data_slot(self, held: int | None) -> None:
        """Raise ``AdmissionError`` when the coordinator no longer gives this peer its data
        stream (out of touch past the lease, and another peer took it)."""
        if self.data_slot is not None and held != self.data_slot:
            raise AdmissionError(
                f"the coordinator gave this peer's data stream {self.data_slot} to another peer "
                f"(it now holds {'none' if held is None else held}); restart the peer to get a free one"
            )

    def _rejoin(self) -> None:
        info = self.client.join_as(self.rejoin)
        self._check_data_slot(info.data_slot)
        self._renew_at = _renewal_time(info.access_token)
        try:
            self.on_token(info.access_token)
        except Exception:
            logger.exception("could not publish the new access token")

    def _flush_reports(self, until: float | None = None) -> None:
        """Send the waiting reports, oldest first; raises (the rest kept) if one did not go.
        ``until`` (monotonic): stop there, the rest kept, so that a backlog (every round of an
        outage, on a busy coordinator) never holds back the next heartbeat, which is what keeps
        this peer online: one held back 80 reports long missed the coordinator's window."""
        with self._flush_lock:
            sent = 0
            while (body := self.outbox.first()) is not None:
                if sent and until is not None and time.monotonic() >= until:
                    return  # at least one goes each time: the backlog always drains
                sent += 1
                try:
                    self.client.report_round(body)  # raises if unreachable: kept for the next try
                except RejectedError as exc:
                    logger.warning("coordinator refused the report of round %d: %s", body.round, exc)
                self.outbox.done(body)

    def stop(self) -> None:
        """Send what is waiting and say we leave (best effort, bounded by the RPC timeouts);
        what the coordinator did not take stays in the outbox for the next start."""
        self.stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout=2 * RPC_TIMEOUT_S)
        self.status = pb.HeartbeatBody(
            round=self.status.round, phase=pb.PEER_PHASE_LEAVING, rounds_failed=self.rounds_failed
        )
        try:
            self._flush_reports()
            self._note_credit(self.client.heartbeat(self.status))
        except SwarmtrainError as exc:
            logger.info("could not tell the coordinator we leave: %s", exc)


def _renewal_time(token: bytes) -> float:
    """When to ask for a new token: half-way through this one's validity."""
    decoded = decode_token(token)
    return decoded.issued_at + (decoded.expires_at - decoded.issued_at) / 2
