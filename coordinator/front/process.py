"""A heartbeat process: takes peers' heartbeats and round reports on a port of its own,
answering heartbeats from a table the core keeps current (``coordinator.front.link``), so that a
coordinator of thousands spends its own interpreter on its state (recording reports, joins,
ticks), not on gRPC and signatures.

Each heartbeat is checked here as the core would (size, parse, signature, age, replay, bounds,
admitted), answered from the table, and sent to the core in batches every ``FLUSH_S``, where
it is applied (``Heartbeats.apply_beats``: admitted still, and checked once more against
replays, since a beat replayed to a second heartbeat process passes that one's guard). A key
the table does not hold is told to join again, and nothing of it is recorded.

A round report is checked here the same way, sent to the core at once (``Report``), recorded
there in the next batch (``coordinator.reports``) and answered when the core says its batch
committed (``Reported``): an answered report is as durable as on the main port. The process
imports neither the store nor the core: it holds no state a crash could lose (a report waiting
for its answer when it dies is sent again by its peer).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from coordinator.admission import parse_body
from coordinator.front.wire import (
    FAILED,
    NOT_ADMITTED,
    READY,
    SERVICE,
    STOP,
    Acked,
    Answer,
    Answers,
    Beat,
    Beats,
    Report,
    Reported,
)
from coordinator.limits import MAX_REQUEST_BYTES, check_heartbeat, check_report
from coordinator.ratelimit import SourceLimiter, source_host
from coordinator.refusals import REFUSED, refusal
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, MalformedMessageError
from protocol.messages import MessageVerifier, SignedMessage

logger = logging.getLogger(__name__)

FLUSH_S = 0.1
"""How often verified heartbeats go to the core: their figures reach status this much later."""
THREADS = 128
"""A report holds its thread until its batch commits (tens of ms, seconds in a burst)."""
MAX_HEARTBEAT_BYTES = 16 << 10
"""Largest heartbeat read: one is a few hundred bytes (a report may be up to ``MAX_REQUEST_BYTES``)."""
REPORT_WAIT_S = 60.0
"""Longest a report waits here for the core's answer (less where its peer's deadline is sooner):
then UNAVAILABLE, and the peer sends it again later (a resent report is answered "already
reported")."""


@dataclass(frozen=True)
class FrontConfig:
    host: str
    port: int
    """0: any free port (a single process)."""
    reuse_port: bool
    """Several processes share ``port`` (SO_REUSEPORT; the kernel spreads connections)."""
    max_requests_per_source: float
    """Heartbeats per second from one source host (0: no limit)."""
    heartbeat_interval_s: float
    max_age_s: float
    max_future_s: float


class Front:
    """The heartbeat handler and its table (the gRPC server and the pipe are ``run``'s)."""

    def __init__(self, config: FrontConfig, send: Any) -> None:
        self.config = config
        self.send = send
        """Sends a record to the core (thread-safe)."""
        self.table: dict[str, Answer] = {}
        self.verifier = MessageVerifier(max_age_s=config.max_age_s, max_future_s=config.max_future_s)
        rate = config.max_requests_per_source
        self.limiter = SourceLimiter(rate) if rate > 0 else None
        self._beats: list[Beat] = []
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}
        self._ids = itertools.count(1)

    def heartbeat(self, raw: bytes, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        now = time.time()
        self._limit(context)
        if len(raw) > MAX_HEARTBEAT_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a heartbeat is at most {MAX_HEARTBEAT_BYTES} bytes")
        try:
            return self._answer(raw, now)
        except (DecodeError, RuntimeWarning) as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except REFUSED as exc:
            self._refuse(context, refusal(exc), exc)
        raise AssertionError("unreachable")

    def report(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """A round report, answered (a serialized ``RoundReportResponse``) once the core
        committed it."""
        now = time.time()
        self._limit(context)
        try:
            report = self._report(raw, now)
        except (DecodeError, RuntimeWarning) as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except REFUSED as exc:
            self._refuse(context, refusal(exc), exc)
        waiting = _Waiting()
        with self._lock:
            self._waiting[report.id] = waiting
        try:
            self.send(report)
            left = context.time_remaining()
            if not waiting.done.wait(REPORT_WAIT_S if left is None else min(REPORT_WAIT_S, max(0.0, left))):
                context.abort(grpc.StatusCode.UNAVAILABLE, "the report was not recorded in time: send it again later")
        finally:
            with self._lock:
                self._waiting.pop(report.id, None)
        reported = waiting.reported
        assert reported is not None
        if reported.response is None:
            context.abort(grpc.StatusCode[reported.code], reported.message)
            raise AssertionError("unreachable")  # abort raises
        return reported.response

    def _report(self, raw: bytes, now: float) -> Report:
        try:
            request = pb.RoundReportRequest.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            raise MalformedMessageError(f"malformed RoundReportRequest: {exc}") from exc
        message = SignedMessage.from_proto(request.signed)
        self.verifier.verify(message, now=now, kind=kinds.ROUND_REPORT, record=False)
        body = parse_body(pb.RoundReportBody, message.body, kinds.ROUND_REPORT)
        key = message.signer.id
        if key not in self.table:  # a stranger, or dropped: nothing of it is recorded
            raise AdmissionError(f"{key} is not admitted: join again before reporting")
        self.verifier.record(message, now=now)
        check_report(body)
        return Report(next(self._ids), key, message.signer.raw, message.nonce, message.timestamp, message.body, now)

    def reported(self, answer: Reported) -> None:
        """The core's answer to a report (one no longer waited for is dropped)."""
        with self._lock:
            waiting = self._waiting.get(answer.id)
        if waiting is not None:
            waiting.reported = answer
            waiting.done.set()

    def _limit(self, context: grpc.ServicerContext) -> None:
        if self.limiter is not None:
            source = source_host(context.peer())
            if not self.limiter.allow(source, time.monotonic()):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many requests from {source}: slow down")

    def _answer(self, raw: bytes, now: float) -> pb.HeartbeatResponse:
        try:
            request = pb.HeartbeatRequest.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            raise MalformedMessageError(f"malformed HeartbeatRequest: {exc}") from exc
        message = SignedMessage.from_proto(request.signed)
        self.verifier.verify(message, now=now, kind=kinds.HEARTBEAT, record=False)
        body = parse_body(pb.HeartbeatBody, message.body, kinds.HEARTBEAT)
        key = message.signer.id
        interval = self.config.heartbeat_interval_s
        answer = self.table.get(key)
        if answer is None:  # a stranger, or dropped: nothing of it is recorded
            return pb.HeartbeatResponse(
                server_time=now, heartbeat_interval_s=interval, admitted=False, message=NOT_ADMITTED
            )
        self.verifier.record(message, now=now)
        check_heartbeat(body)
        beat = Beat(key, message.signer.raw, message.nonce, message.timestamp, message.body, now)
        with self._lock:
            self._beats.append(beat)
        response = pb.HeartbeatResponse(server_time=now, heartbeat_interval_s=interval, admitted=True)
        answer.fill(response)
        return response

    def apply(self, update: Answers) -> None:
        """The core's changes to the table."""
        self.table.update(update.answers)  # one step each: handlers read whole entries
        for key in update.dropped:
            self.table.pop(key, None)

    def flush(self) -> None:
        """Send the heartbeats verified since the last flush to the core."""
        with self._lock:
            beats, self._beats = self._beats, []
        if beats:
            self.send(Beats(tuple(beats)))

    @staticmethod
    def _refuse(context: grpc.ServicerContext, code: grpc.StatusCode | None, exc: Exception) -> NoReturn:
        logger.info("refused a request: %s", exc)
        context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")  # abort raises


@dataclass
class _Waiting:
    """A report waiting for the core's answer."""

    done: threading.Event = field(default_factory=threading.Event)
    reported: Reported | None = None


def run(conn: Connection, config: FrontConfig) -> None:
    """The process's main: serve until the core says stop or goes away."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s heartbeats %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(record: object) -> None:
        with send_lock:
            conn.send(record)

    front = Front(config, send)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=THREADS),
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.so_reuseport", 1 if config.reuse_port else 0),
        ],
    )
    handlers = {
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            front.heartbeat, request_deserializer=None, response_serializer=pb.HeartbeatResponse.SerializeToString
        ),
        "ReportRound": grpc.unary_unary_rpc_method_handler(
            front.report, request_deserializer=None, response_serializer=None
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError:
        port = 0
    if port == 0:
        send((FAILED, f"cannot listen on {config.host}:{config.port}: choose another --heartbeat-port"))
        return
    server.start()
    send((READY, port))
    stopped = threading.Event()

    def flush_forever() -> None:
        while not stopped.wait(FLUSH_S):
            try:
                front.flush()
            except (OSError, ValueError):  # the core is gone
                return

    flusher = threading.Thread(target=flush_forever, daemon=True)
    flusher.start()
    try:
        while True:
            record = conn.recv()
            if record == STOP:
                break
            if isinstance(record, Answers):
                front.apply(record)
                send(Acked(record.seq))
            elif isinstance(record, Reported):
                front.reported(record)
    except (EOFError, OSError):  # the core is gone: so is this
        pass
    finally:
        stopped.set()
        server.stop(grace=1).wait()
        try:
            front.flush()
        except (OSError, ValueError):
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m coordinator.front.process --fd FD --config JSON``: ``run`` on the pipe the
    core passed as ``FD`` (``coordinator.front.link``), with ``FrontConfig`` as JSON."""
    parser = argparse.ArgumentParser(prog="python -m coordinator.front.process")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    fields = json.loads(args.config)
    config = FrontConfig(**{f.name: fields[f.name] for f in dataclasses.fields(FrontConfig)})
    run(Connection(args.fd), config)


if __name__ == "__main__":
    main()
