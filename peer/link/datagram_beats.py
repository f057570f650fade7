"""A peer's heartbeats as UDP datagrams to the coordinator's heartbeat port
(``protocol.heartbeat_datagram``): one datagram out, one answer back, matched by the beat's nonce.

A beat that is not answered within ``TIMEOUT_S`` (lost, a firewall that drops UDP, a coordinator
that does not take datagrams, or one that does not count this peer as admitted: it answers only
admitted peers) is sent again over gRPC by the caller, signed afresh, and gRPC's answer says why.
After ``MISSES_TO_REST`` unanswered beats in a row the datagrams rest for ``REST_S``: a peer
whose path drops them loses a second on a few beats every few minutes, not on every beat.

The socket is connected to the coordinator's address, so the kernel delivers only datagrams
from there; an answer must carry the beat's 16 random nonce bytes, which no one off the path
can guess. On the path, a forged answer is as possible as over the plain gRPC channel.
"""

from __future__ import annotations

import logging
import socket
import time

from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.heartbeat_datagram import MAX_DATAGRAM_BYTES, parse_answer, request

logger = logging.getLogger(__name__)

__all__ = ["DatagramBeats", "MISSES_TO_REST", "REST_S", "TIMEOUT_S"]

TIMEOUT_S = 1.0
"""A beat unanswered this long goes over gRPC (a loaded coordinator answers within ~0.25 s)."""
MISSES_TO_REST = 3
REST_S = 300.0


class DatagramBeats:
    """Heartbeats as datagrams to ``host``:``port``."""

    def __init__(self, host: str, port: int, *, timeout_s: float = TIMEOUT_S) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        self.address = f"{host}:{port}"
        self.timeout_s = timeout_s
        self.sock = socket.socket(family, kind, proto)
        try:
            self.sock.connect(address)
        except OSError:
            self.sock.close()
            raise
        self.answered = 0
        self.missed = 0
        self._misses_in_a_row = 0
        self._rest_until = -float("inf")

    @property
    def resting(self) -> bool:
        return time.monotonic() < self._rest_until

    def send(self, beat: pb.HeartbeatRequest) -> pb.HeartbeatResponse | None:
        """The coordinator's answer to ``beat``, or None (resting, too big for a datagram, or
        unanswered: send a fresh one another way)."""
        if self.resting:
            return None
        try:
            data = request(beat)
        except ValueError:
            return None
        nonce = bytes(beat.signed.nonce)
        deadline = time.monotonic() + self.timeout_s
        try:
            self._drain()
            self.sock.send(data)
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                try:
                    answered, response = parse_answer(self.sock.recv(MAX_DATAGRAM_BYTES + 1))
                except MalformedMessageError:
                    continue
                if answered == nonce:
                    self.answered += 1
                    self._misses_in_a_row = 0
                    return response
        except TimeoutError:
            pass
        except OSError as exc:  # the port is closed (ICMP port unreachable), no route
            logger.debug("heartbeat datagram to %s: %s", self.address, exc)
        self._missed()
        return None

    def _drain(self) -> None:
        """Drop late answers to earlier beats, so they are not read as this one's."""
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(MAX_DATAGRAM_BYTES + 1)
        except (BlockingIOError, OSError):
            pass
        finally:
            self.sock.setblocking(True)

    def _missed(self) -> None:
        self.missed += 1
        self._misses_in_a_row += 1
        if self._misses_in_a_row >= MISSES_TO_REST:
            self._misses_in_a_row = 0
            self._rest_until = time.monotonic() + REST_S
            logger.info(
                "%d heartbeat datagrams to %s went unanswered: heartbeats go over gRPC for %.0f s",
                MISSES_TO_REST,
                self.address,
                REST_S,
            )

    def close(self) -> None:
        self.sock.close()
