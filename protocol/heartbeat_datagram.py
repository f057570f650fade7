"""Heartbeats as UDP datagrams: the wire both ends share (``coordinator.front.datagrams`` answers,
``peer.link.datagram_beats`` sends).

A heartbeat is a few hundred bytes and its answer fewer; over gRPC each costs the coordinator's
heartbeat process ~0.35 ms of Python server work on top of the ~0.14 ms Ed25519 check, measured
(``benchmarks/heartbeat_transport.py``), and at 10,000 peers that server work is most of what the
process does. As a datagram the same signed ``HeartbeatRequest`` travels on the heartbeat port's
number over UDP:

- request: ``REQUEST_TAG`` + a serialized ``HeartbeatRequest`` (the same signed envelope gRPC
  carries, checked the same way);
- answer: ``ANSWER_TAG`` + the request's 16-byte nonce + a serialized ``HeartbeatResponse``.

Only a heartbeat that passed every check (signature, age, replay, bounds) from an admitted key is
answered: a spoofed source gets nothing back unless it holds a fresh beat signed by an admitted
peer, which it can send once (replays are refused), and an answer is smaller than its request, so
the port amplifies nothing. Everything else (a stranger, a replay, garbage) is dropped in
silence; the peer, hearing nothing within a second, sends a freshly signed beat over gRPC,
which answers with the reason.
"""

from __future__ import annotations

from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.messages import NONCE_BYTES

__all__ = ["ANSWER_TAG", "MAX_DATAGRAM_BYTES", "REQUEST_TAG", "answer", "parse_answer", "parse_request", "request"]

REQUEST_TAG = b"stH1"
ANSWER_TAG = b"stA1"
MAX_DATAGRAM_BYTES = 1200
"""Largest datagram either end reads or sends: under every path's MTU (IPv6's minimum is 1280),
so a heartbeat is never fragmented. A heartbeat larger than this goes over gRPC."""


def request(beat: pb.HeartbeatRequest) -> bytes:
    """A heartbeat as a datagram (raises ``ValueError`` when it does not fit in one)."""
    data = REQUEST_TAG + beat.SerializeToString()
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ValueError(f"a heartbeat of {len(data)} bytes does not fit in a datagram")
    return data


def parse_request(data: bytes) -> bytes:
    """The serialized ``HeartbeatRequest`` a datagram carries (raises ``MalformedMessageError``)."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise MalformedMessageError(f"a heartbeat datagram of {len(data)} bytes (at most {MAX_DATAGRAM_BYTES})")
    if not data.startswith(REQUEST_TAG):
        raise MalformedMessageError("not a heartbeat datagram (wrong tag)")
    return data[len(REQUEST_TAG) :]


def answer(nonce: bytes, response: pb.HeartbeatResponse) -> bytes:
    """The answer to the heartbeat signed with ``nonce``."""
    return ANSWER_TAG + nonce + response.SerializeToString()


def parse_answer(data: bytes) -> tuple[bytes, pb.HeartbeatResponse]:
    """(the nonce answered, the response) from an answer datagram (raises ``MalformedMessageError``)."""
    head = len(ANSWER_TAG) + NONCE_BYTES
    if len(data) > MAX_DATAGRAM_BYTES or len(data) < head or not data.startswith(ANSWER_TAG):
        raise MalformedMessageError("not a heartbeat answer")
    try:
        response = pb.HeartbeatResponse.FromString(data[head:])
    except Exception as exc:  # protobuf's DecodeError, and RuntimeWarning/ValueError on odd input
        raise MalformedMessageError(f"malformed heartbeat answer: {exc}") from exc
    return data[len(ANSWER_TAG) : head], response
