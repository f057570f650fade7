"""The core's side of the round reports its heartbeat processes took (``coordinator.front``):
each was checked there (signature, age, bounds, admitted by that process's table, not a replay
there); here it must still be admitted (banned since, say) and must not be a replay that a second
process took too. Then it is recorded with the next batch (``coordinator.reports``) and its
answer goes back to the process once that batch committed."""

from __future__ import annotations

import logging
from collections.abc import Callable

from google.protobuf.message import DecodeError

from coordinator.front.wire import Report, Reported
from coordinator.limits import check_report
from coordinator.refusals import REFUSED, refusal
from coordinator.reports import Outcome, ReportWriter
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, MalformedMessageError
from protocol.identity import PublicKey
from protocol.messages import MessageVerifier

logger = logging.getLogger(__name__)


class FrontReports:
    """Takes the reports of the heartbeat processes (see the module doc). Thread-safe."""

    def __init__(
        self, writer: Callable[[], ReportWriter], verifier: MessageVerifier, admitted: Callable[[PublicKey], bool]
    ) -> None:
        """``writer``: the report writer (looked up per report: the server makes it after the
        processes start)."""
        self.writer, self.verifier, self.admitted = writer, verifier, admitted

    def take(self, report: Report, answer: Callable[[Reported], None], *, now: float) -> None:
        """Check ``report`` and record it with the next batch; ``answer`` gets what the process
        answers its peer with (at once for a refused report, else once committed)."""
        try:
            peer = PublicKey(report.signer)
            if peer.id != report.key or not self.admitted(peer):
                raise AdmissionError(f"{report.key} is not admitted: join again before reporting")
            try:
                body = pb.RoundReportBody.FromString(report.body)
            except (DecodeError, RuntimeWarning) as exc:
                raise MalformedMessageError(f"malformed RoundReportBody: {exc}") from exc
            check_report(body)
            self.verifier.record_nonce(report.signer, report.nonce, report.timestamp, now=now, what=kinds.ROUND_REPORT)
        except REFUSED as exc:
            logger.info("a heartbeat process's report of %s refused: %s", report.key, exc)
            answer(_reported(report.id, exc))
            return
        self.writer().submit_async(
            (report.key, body, min(report.received_at, now)), lambda outcome: answer(_reported(report.id, outcome))
        )


def _reported(id_: int, outcome: Outcome) -> Reported:
    if isinstance(outcome, pb.RoundReportResponse):
        return Reported(id_, outcome.SerializeToString())
    code = refusal(outcome)
    if code is None:  # the database is away, say: the peer sends it again later
        logger.warning("a report was not recorded: %s", outcome)
        return Reported(
            id_, None, "UNAVAILABLE", f"the report was not recorded ({type(outcome).__name__}): send it again later"
        )
    return Reported(id_, None, code.name, str(outcome))
