"""A heartbeat process: takes peers' heartbeats on a port of its own and answers them from a
table the core keeps current (``coordinator.front.link``), so that a coordinator of thousands
spends its own interpreter on joins, reports and ticks.

Each heartbeat is checked here as the core would (size, parse, signature, age, replay, bounds,
admitted), answered from the table, and sent to the core in batches every ``FLUSH_S``, where
it is applied (``Heartbeats.apply_beats``: admitted still, and checked once more against
replays, since a beat replayed to a second heartbeat process passes that one's guard). A key
the table does not hold is told to join again, and nothing of it is recorded. The same
heartbeats arrive as UDP datagrams on the port's number (``coordinator.front.datagrams``,
``Front.datagram``): checked the same way, and answered only when admitted. The process
imports neither the store nor the core: it holds no state a crash could lose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coordinator.admission import parse_body
from coordinator.front.datagrams import WAKE_S, open_socket, serve
from coordinator.front.flood_guard import FloodGuard
from coordinator.front.wire import FAILED, NOT_ADMITTED, READY, SERVICE, STOP, Acked, Answer, Answers, Beat, Beats
from coordinator.limits import check_heartbeat
from coordinator.ratelimit import SourceLimiter, source_host
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import BadSignatureError, MalformedMessageError, ReplayedMessageError, VerificationError
from protocol.heartbeat_datagram import answer, parse_request
from protocol.messages import MessageVerifier, SignedMessage

logger = logging.getLogger(__name__)

FLUSH_S = 0.1
"""How often verified heartbeats go to the core: their figures reach status this much later."""
THREADS = 16
LISTEN_TRIES = 20
"""Port 0: UDP numbers tried before one is also free on TCP."""
MAX_HEARTBEAT_BYTES = 16 << 10
"""Largest request read: a heartbeat is a few hundred bytes."""


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
        self.datagram_limiter = SourceLimiter(rate) if rate > 0 else None
        """Datagrams' own buckets: a flood forged from a host's address must not use up that
        host's gRPC heartbeats."""
        self.flood = FloodGuard()

    def heartbeat(self, raw: bytes, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        now = time.time()
        if self.limiter is not None:
            source = source_host(context.peer())
            if not self.limiter.allow(source, time.monotonic()):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many requests from {source}: slow down")
        try:
            return self._answer(raw, now)[0]
        except MalformedMessageError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except VerificationError as exc:
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, exc)
        except (DecodeError, ValueError, RuntimeWarning) as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        raise AssertionError("unreachable")

    def datagram(self, data: bytes, source: str) -> bytes | None:
        """The answer to a heartbeat datagram from host ``source`` (``protocol.heartbeat_datagram``),
        or None: only a beat that passed every check from an admitted key is answered, and
        whatever else arrives (a stranger, a replay, garbage, a source over its rate) is dropped
        without a word, as a spoofed source must learn nothing. What costs no signature check
        (a key the table does not hold, the kind, the age, a replay already seen) is judged
        first; what a flood of forged signatures may cost is bounded by ``FloodGuard``."""
        now, clock = time.time(), time.monotonic()
        if self.datagram_limiter is not None and not self.datagram_limiter.allow(source, clock):
            return None
        try:
            message = self._parse(parse_request(data))
            key = message.signer.id
            if key not in self.table:
                return None
            self.verifier.screen(message, now=now, kind=kinds.HEARTBEAT)
        except (VerificationError, DecodeError, ValueError, RuntimeWarning) as exc:
            logger.debug("dropped a heartbeat datagram from %s: %s", source, exc)
            return None
        if not self.flood.admits(key, source, clock):
            return None
        try:
            response = self._check(message, now)
        except (VerificationError, ValueError, RuntimeWarning) as exc:
            logger.debug("dropped a heartbeat datagram from %s: %s", source, exc)
            if isinstance(exc, (BadSignatureError, ReplayedMessageError)):
                self.flood.failed(clock)
            return None
        if not response.admitted:
            return None
        self.flood.proved(key, source, clock)
        return answer(message.nonce, response)

    def _answer(self, raw: bytes, now: float) -> tuple[pb.HeartbeatResponse, bytes]:
        """The answer to a serialized ``HeartbeatRequest`` and the nonce it was signed with."""
        message = self._parse(raw)
        return self._check(message, now), message.nonce

    @staticmethod
    def _parse(raw: bytes) -> SignedMessage:
        try:
            request = pb.HeartbeatRequest.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            raise MalformedMessageError(f"malformed HeartbeatRequest: {exc}") from exc
        return SignedMessage.from_proto(request.signed)

    def _check(self, message: SignedMessage, now: float) -> pb.HeartbeatResponse:
        """Check ``message`` as the core would; its answer (a stranger's: join again)."""
        self.verifier.verify(message, now=now, kind=kinds.HEARTBEAT, record=False)
        body = parse_body(pb.HeartbeatBody, message.body, kinds.HEARTBEAT)
        key = message.signer.id
        interval = self.config.heartbeat_interval_s
        known = self.table.get(key)
        if known is None:  # a stranger, or dropped: nothing of it is recorded
            return pb.HeartbeatResponse(
                server_time=now, heartbeat_interval_s=interval, admitted=False, message=NOT_ADMITTED
            )
        self.verifier.record(message, now=now)
        check_heartbeat(body)
        beat = Beat(key, message.signer.raw, message.nonce, message.timestamp, message.body, now)
        with self._lock:
            self._beats.append(beat)
        response = pb.HeartbeatResponse(server_time=now, heartbeat_interval_s=interval, admitted=True)
        known.fill(response)
        return response

    def apply(self, update: Answers) -> None:
        """The core's changes to the table."""
        self.table.update(update.answers)  # one step each: handlers read whole entries
        for key in update.dropped:
            self.table.pop(key, None)
            self.flood.forget(key)

    def flush(self) -> None:
        """Send the heartbeats verified since the last flush to the core."""
        with self._lock:
            beats, self._beats = self._beats, []
        if beats:
            self.send(Beats(tuple(beats)))

    @staticmethod
    def _refuse(context: grpc.ServicerContext, code: grpc.StatusCode, exc: Exception) -> None:
        logger.info("refused a heartbeat: %s", exc)
        context.abort(code, str(exc))


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
            ("grpc.max_receive_message_length", MAX_HEARTBEAT_BYTES),
            ("grpc.so_reuseport", 1 if config.reuse_port else 0),
        ],
    )
    handler = grpc.unary_unary_rpc_method_handler(
        front.heartbeat, request_deserializer=None, response_serializer=pb.HeartbeatResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": handler}),))
    listening = _listen(server, config)
    if listening is None:
        send((FAILED, f"cannot listen on {config.host}:{config.port}: choose another --heartbeat-port"))
        return
    port, datagram_socket = listening
    server.start()
    send((READY, port))
    stopped = threading.Event()
    datagram_reader = threading.Thread(target=serve, args=(datagram_socket, front.datagram, stopped), daemon=True)
    if datagram_socket is not None:
        datagram_reader.start()

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
    except (EOFError, OSError):  # the core is gone: so is this
        pass
    finally:
        stopped.set()
        if datagram_socket is not None:
            datagram_reader.join(timeout=2 * WAKE_S)
            datagram_socket.close()
        server.stop(grace=1).wait()
        try:
            front.flush()
        except (OSError, ValueError):
            pass


def _listen(server: grpc.Server, config: FrontConfig) -> tuple[int, socket.socket | None] | None:
    """Bind the heartbeat port: gRPC on TCP and the datagrams on UDP, one number; None where
    TCP cannot be bound. Port 0: a number free for both (UDP's picked first, a few tries). A
    UDP number taken by something else costs only the datagrams (peers beat over gRPC)."""
    for _ in range(LISTEN_TRIES if config.port == 0 else 1):
        try:
            sock: socket.socket | None = open_socket(config.host, config.port, reuse_port=config.reuse_port)
        except OSError as exc:
            logger.warning("no heartbeat datagrams: cannot take UDP port %s: %s", config.port, exc)
            sock = None
        port = int(sock.getsockname()[1]) if sock is not None else config.port
        try:
            bound = server.add_insecure_port(f"{config.host}:{port}")
        except RuntimeError:
            bound = 0
        if bound and (port == 0 or bound == port):
            return bound, sock
        if sock is not None:
            sock.close()
    return None


def main(argv: list[str] | None = None) -> None:
    """``python -m coordinator.front.process --fd FD --config JSON``: ``run`` on the pipe the
    core passed as ``FD`` (``coordinator.front.link``), with ``FrontConfig`` as JSON."""
    parser = argparse.ArgumentParser(prog="python -m coordinator.front.process")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    # the core ends this process (STOP, or its end of the pipe closing); a Ctrl-C at the
    # terminal reaches the whole process group and is the core's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fields = json.loads(args.config)
    config = FrontConfig(**{f.name: fields[f.name] for f in dataclasses.fields(FrontConfig)})
    run(Connection(args.fd), config)


if __name__ == "__main__":
    main()
