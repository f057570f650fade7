"""Bounds on every number and string a peer sends the coordinator (issue #14).

Everything in a join, heartbeat or round report is the peer's say-so, signed or not. A value
past these bounds is refused with ``MalformedMessageError`` naming the field (gRPC
INVALID_ARGUMENT) before anything is stored: no column (32-bit rounds on PostgreSQL, 64-bit
sample counts), sum (credits, swarm samples/s) or metric can overflow, and no text holds a NUL
(PostgreSQL refuses it mid-transaction).
"""

from __future__ import annotations

import math
import re

from protocol import coordinator_pb2 as pb
from protocol.errors import MalformedMessageError
from protocol.messages import MAX_REPORTED_SAMPLES
from protocol.receipts import MAX_RECEIPT_BYTES, REPORTED_RECEIPTS

__all__ = [
    "MAX_BYTES",
    "MAX_GROUP",
    "MAX_ROUND",
    "MAX_SAMPLES",
    "MAX_SECONDS",
    "MAX_TEXT",
    "check_hardware",
    "check_heartbeat",
    "check_report",
    "check_text",
]

MAX_ROUND = 2**31 - 1
"""Rounds are 32-bit columns."""
MAX_SAMPLES = MAX_REPORTED_SAMPLES
"""Samples in one round report or weight (shared with the peers, which clamp what their
group members gathered to it before reporting)."""
MAX_SECONDS = 1e7
"""Compute or wait time of one round (~115 days)."""
MAX_BYTES = 2**53
MAX_GROUP = 4096
"""Members of one group (a round's group is the whole swarm: far above a public run's size)."""
MAX_TEXT = 512
"""Characters of a digest, id, version or hardware name."""


def check_text(field: str, value: str, limit: int = MAX_TEXT) -> None:
    """Refuse text longer than ``limit`` characters or holding a NUL."""
    if len(value) > limit:
        raise MalformedMessageError(f"{field} is {len(value)} characters long, at most {limit} allowed")
    if "\x00" in value:
        raise MalformedMessageError(f"{field} contains a NUL character")


def _check_range(field: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise MalformedMessageError(f"{field} must be a finite number in [{low:g}, {high:g}], got {value!r}")


def check_report(body: pb.RoundReportBody) -> None:
    """Refuse a round report with a value out of bounds (the ledger checks its consistency)."""
    _check_range("round report round", body.round, 0, MAX_ROUND)
    _check_range("round report samples", body.samples, 0, MAX_SAMPLES)
    _check_range("round report compute_s", body.compute_s, 0, MAX_SECONDS)
    _check_range("round report wait_s", body.wait_s, 0, MAX_SECONDS)
    _check_range("round report bytes_sent", body.bytes_sent, 0, MAX_BYTES)
    _check_range("round report bytes_received", body.bytes_received, 0, MAX_BYTES)
    _check_range("round report allreduce_s", body.allreduce_s, 0, MAX_SECONDS)
    _check_range("round report host_s", body.host_s, 0, MAX_SECONDS)
    _check_range("round report matchmaking_s", body.matchmaking_s, 0, MAX_SECONDS)
    if math.isinf(body.loss):
        raise MalformedMessageError(f"round report loss must be finite or NaN, got {body.loss!r}")
    check_text("round report state_digest", body.state_digest)
    if len(body.group) > MAX_GROUP:
        raise MalformedMessageError(f"round report group lists {len(body.group)} members, at most {MAX_GROUP}")
    for member in body.group:
        _check_range("round report group weight", member.weight, 0, MAX_SAMPLES)
        check_text("round report group libp2p_peer_id", member.libp2p_peer_id)
        if len(member.receipt) > MAX_RECEIPT_BYTES:
            raise MalformedMessageError(
                f"round report receipt is {len(member.receipt)} bytes, at most {MAX_RECEIPT_BYTES}"
            )
    receipts = sum(1 for member in body.group if member.receipt)
    if receipts > REPORTED_RECEIPTS:
        raise MalformedMessageError(f"round report carries {receipts} receipts, at most {REPORTED_RECEIPTS}")
    if body.HasField("validation_loss"):
        _check_range("round report validation_loss", body.validation_loss, 0, 1e6)
    if body.HasField("data"):
        _check_range("round report data round", body.data.round, 0, MAX_ROUND)
        _check_range("round report data slot", body.data.slot, 0, 65535)
        _check_range("round report data steps", body.data.steps, 0, 2**31 - 1)
        _check_range("round report data epoch", body.data.epoch, 0, 1e9)
        if not re.fullmatch(r"[0-9a-f]{32}", body.data.ids_digest):
            raise MalformedMessageError("round report data ids_digest must be 32 lowercase hex digits")


def check_heartbeat(body: pb.HeartbeatBody) -> None:
    """Refuse a heartbeat with a value out of bounds (the health tracker checks the rest)."""
    _check_range("heartbeat round", body.round, 0, MAX_ROUND)
    _check_range("heartbeat samples_total", body.samples_total, 0, 2**62)
    _check_range("heartbeat samples_per_second", body.samples_per_second, 0, 1e12)
    _check_range("heartbeat rounds_failed", body.rounds_failed, 0, MAX_ROUND)
    _check_range("heartbeat punched_peers", body.punched_peers, 0, MAX_PUNCHED_PEERS)
    check_text("heartbeat state_digest", body.state_digest)


MAX_PUNCHED_PEERS = 100_000
"""More peers than a run has: a heartbeat that says it reaches more directly is malformed."""

NETWORK_PATHS = ("", "direct", "announced", "relayed", "client")
"""What a peer may say of how it is reached (``peer.net.network_path``; "" before it knows)."""


def check_network_path(path: str) -> None:
    """Refuse a join whose network path is not one of ``NETWORK_PATHS``."""
    if path not in NETWORK_PATHS:
        raise MalformedMessageError(f"join network_path must be one of {NETWORK_PATHS[1:]} or empty, got {path[:40]!r}")


def check_relay_port(port: int) -> None:
    """Refuse a join whose relay port is not a TCP port (0: it runs no relay)."""
    if not 0 <= port <= 65535:
        raise MalformedMessageError(f"join relay_port must be a TCP port (1..65535) or 0 for none, got {port}")


def check_hardware(hardware: pb.Hardware) -> None:
    """Refuse a join's hardware description with text out of bounds."""
    check_text("join hardware device", hardware.device)
    check_text("join hardware accelerator_name", hardware.accelerator_name)
