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

The server is gRPC's asyncio one, on the main thread's event loop: a report waiting for the core
holds no thread, so a round's burst of reports never delays a heartbeat behind it. A reader
thread takes the core's records from the pipe, a sender thread sends this process's (the event
loop never waits on the pipe) and a flusher thread batches the verified heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

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


class Refusal(Exception):
    """A request refused: the gRPC status and message its caller is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class Front:
    """The checks, the table and the reports waiting (the server and the pipe are ``run``'s).
    Thread-safe; nothing here waits."""

    def __init__(self, config: FrontConfig, send: Any) -> None:
        self.config = config
        self.send = send
        """Sends a record to the core (thread-safe, never waits)."""
        self.table: dict[str, Answer] = {}
        self.verifier = MessageVerifier(max_age_s=config.max_age_s, max_future_s=config.max_future_s)
        rate = config.max_requests_per_source
        self.limiter = SourceLimiter(rate) if rate > 0 else None
        self._beats: list[Beat] = []
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[Reported]] = {}
        self._ids = itertools.count(1)

    def heartbeat(self, raw: bytes, *, source: str, now: float) -> pb.HeartbeatResponse:
        """A heartbeat's answer; ``Refusal`` for one refused."""
        self._limit(source)
        if len(raw) > MAX_HEARTBEAT_BYTES:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a heartbeat is at most {MAX_HEARTBEAT_BYTES} bytes")
        return _checked(self._answer, raw, now)

    def submit_report(self, raw: bytes, *, source: str, now: float) -> tuple[int, Future[Reported]]:
        """Check a round report and send it to the core: its number and the future of the core's
        answer (``report_answer`` reads it; ``forget`` the number once no longer waited for).
        ``Refusal`` for one refused here."""
        self._limit(source)
        report = _checked(self._report, raw, now)
        waiting: Future[Reported] = Future()
        with self._lock:
            self._waiting[report.id] = waiting
        self.send(report)
        return report.id, waiting

    def reported(self, answer: Reported) -> None:
        """The core's answer to a report (one no longer waited for is dropped)."""
        with self._lock:
            waiting = self._waiting.get(answer.id)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)

    def forget(self, id_: int) -> None:
        with self._lock:
            self._waiting.pop(id_, None)

    @staticmethod
    def report_answer(reported: Reported) -> bytes:
        """The serialized ``RoundReportResponse`` the core answered; ``Refusal`` for a report it refused."""
        if reported.response is None:
            raise Refusal(grpc.StatusCode[reported.code], reported.message)
        return reported.response

    async def report(self, raw: bytes, *, source: str, now: float, deadline_s: float | None) -> bytes:
        """A round report's answer once the core committed it (at most ``REPORT_WAIT_S``, or
        ``deadline_s`` when sooner: then ``Refusal`` UNAVAILABLE, the peer sends it again later)."""
        id_, waiting = self.submit_report(raw, source=source, now=now)
        wait = REPORT_WAIT_S if deadline_s is None else min(REPORT_WAIT_S, max(0.0, deadline_s))
        try:
            reported = await asyncio.wait_for(asyncio.wrap_future(waiting), wait)
        except TimeoutError:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE, "the report was not recorded in time: send it again later"
            ) from None
        finally:
            self.forget(id_)
        return self.report_answer(reported)

    def _limit(self, source: str) -> None:
        if self.limiter is not None and not self.limiter.allow(source, time.monotonic()):
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many requests from {source}: slow down")

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


def _checked(check: Any, raw: bytes, now: float) -> Any:
    """``check(raw, now)``, its errors as the ``Refusal`` the main port would answer them with."""
    try:
        return check(raw, now)
    except (DecodeError, RuntimeWarning) as exc:
        logger.info("refused a request: %s", exc)
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
    except REFUSED as exc:
        logger.info("refused a request: %s", exc)
        raise Refusal(refusal(exc) or grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc


def run(conn: Connection, config: FrontConfig) -> None:
    """The process's main: serve until the core says stop or goes away."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s heartbeats %(levelname)s %(name)s: %(message)s")
    outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    front = Front(config, outbox.put)
    sender = threading.Thread(target=_send_forever, args=(conn, outbox), daemon=True, name="to-core")
    sender.start()
    asyncio.run(_serve(conn, config, front))
    outbox.put(None)  # after what is queued
    sender.join(timeout=5)


def _send_forever(conn: Connection, outbox: queue.SimpleQueue[object]) -> None:
    while (record := outbox.get()) is not None:
        try:
            conn.send(record)
        except (OSError, ValueError):  # the core is gone
            return


async def _serve(conn: Connection, config: FrontConfig, front: Front) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.so_reuseport", 1 if config.reuse_port else 0),
        ]
    )

    async def heartbeat(raw: bytes, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        try:
            return front.heartbeat(raw, source=source_host(context.peer()), now=time.time())
        except Refusal as refused:
            await context.abort(refused.code, refused.message)
            raise AssertionError("unreachable") from None  # abort raises

    async def report(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await front.report(
                raw, source=source_host(context.peer()), now=time.time(), deadline_s=context.time_remaining()
            )
        except Refusal as refused:
            await context.abort(refused.code, refused.message)
            raise AssertionError("unreachable") from None

    handlers = {
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            heartbeat, request_deserializer=None, response_serializer=pb.HeartbeatResponse.SerializeToString
        ),
        "ReportRound": grpc.unary_unary_rpc_method_handler(report, request_deserializer=None, response_serializer=None),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError:
        port = 0
    if port == 0:
        front.send((FAILED, f"cannot listen on {config.host}:{config.port}: choose another --heartbeat-port"))
        return
    await server.start()
    front.send((READY, port))
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    reader = threading.Thread(target=_read_forever, args=(conn, front, loop, stopped), daemon=True, name="from-core")
    reader.start()
    flusher = asyncio.ensure_future(_flush_forever(front, stopped))
    await stopped.wait()
    await server.stop(grace=1)
    await flusher
    front.flush()


def _read_forever(conn: Connection, front: Front, loop: asyncio.AbstractEventLoop, stopped: asyncio.Event) -> None:
    """The core's records, until it says stop or goes away (then so does this process)."""
    try:
        while True:
            record = conn.recv()
            if record == STOP:
                break
            if isinstance(record, Answers):
                front.apply(record)
                front.send(Acked(record.seq))
            elif isinstance(record, Reported):
                front.reported(record)
    except (EOFError, OSError):
        pass
    loop.call_soon_threadsafe(stopped.set)


async def _flush_forever(front: Front, stopped: asyncio.Event) -> None:
    while not stopped.is_set():
        try:
            await asyncio.wait_for(stopped.wait(), FLUSH_S)
        except TimeoutError:
            front.flush()


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
