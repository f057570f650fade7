"""The round report a recorded round makes (``report_body``): the one place a round's record
(``peer.round.round_metrics.RoundMetrics``) is mapped onto the wire
(``protocol/coordinator.proto``, ``RoundReportBody``).

Every scalar field of the report is the record's field of the same name (``_NAMED``), so a
figure added to the report is a field in the proto, one in the record and the line of the part
that produces it (``tests/unit/test_report_body.py`` checks that each has its twin). Durations
(``*_s``) go as finite seconds >= 0 and other floats as finite numbers or NaN: the coordinator
refuses others. The rest is said here: the samples and seconds the round claims
(``RoundMetrics.claimed``), the group with what other members stated bounded, the validation
loss and the data read.
"""

from __future__ import annotations

import logging
import math

from google.protobuf.descriptor import FieldDescriptor

from peer.round.round_metrics import RoundMetrics
from protocol import coordinator_pb2 as pb
from protocol.errors import IdentityError
from protocol.identity import PublicKey
from protocol.messages import MAX_OFFENCE_CHARS, MAX_REPORTED_SAMPLES
from protocol.receipts import reported

logger = logging.getLogger(__name__)

_SAID_HERE = frozenset({"samples", "compute_s", "group", "validation_loss", "data"})
"""Report fields that are not a record field of the same name (see the module doc)."""
_NAMED = tuple(field for field in pb.RoundReportBody.DESCRIPTOR.fields if field.name not in _SAID_HERE)
"""The report's scalar fields, each the record's field of that name."""


def report_body(metrics: RoundMetrics) -> pb.RoundReportBody:
    """The round report of a round this peer averaged, with at most ``REPORTED_RECEIPTS`` of its
    members' receipts (``protocol.receipts.reported``)."""
    receipts = reported(metrics.receipts)
    group = [
        pb.GroupMember(
            public_key=key.raw,
            weight=reported_weight(member.samples),
            offence=str(metrics.offenders.get(member.id, ""))[:MAX_OFFENCE_CHARS],
            receipt=receipts.get(member.id, b""),
        )
        for member in metrics.members
        if (key := _public_key(member.id)) is not None
    ]
    samples, compute_s = metrics.claimed
    body = pb.RoundReportBody(samples=samples, compute_s=_seconds(compute_s), group=group)
    for field in _NAMED:
        setattr(body, field.name, _on_wire(field, getattr(metrics, field.name)))
    if metrics.val_loss is not None and math.isfinite(metrics.val_loss):
        body.validation_loss = metrics.val_loss
    data = metrics.data
    if data is not None:
        body.data.CopyFrom(
            pb.DataRead(
                round=data.round, slot=data.slot, steps=data.steps, ids_digest=data.ids_digest, epoch=data.epoch
            )
        )
    return body


def _on_wire(field: FieldDescriptor, value: object) -> object:
    """``value`` as the report's ``field`` carries it."""
    if field.cpp_type == FieldDescriptor.CPPTYPE_DOUBLE:
        if field.name.endswith("_s"):
            return _seconds(value)
        number = float(value)  # type: ignore[arg-type]
        return number if math.isfinite(number) else math.nan  # no ±inf on the wire
    if field.cpp_type in (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_INT32):
        return int(value)  # type: ignore[call-overload]
    return value


def _seconds(value: object) -> float:
    """A duration as a report may carry it: finite, >= 0 (the coordinator refuses others)."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


def reported_weight(samples: object) -> float:
    """What a member gathered as its samples, as a report may carry it: a number in
    [0, ``MAX_REPORTED_SAMPLES``] (another member's say-so: a member that gathered 1e15 or
    NaN must not make this peer's own report one the coordinator refuses)."""
    try:
        value = float(samples)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return min(value, float(MAX_REPORTED_SAMPLES)) if value >= 0 else 0.0


def _public_key(public_id: str) -> PublicKey | None:
    """The key a member stated as its id; None where it is none (another member's say-so)."""
    try:
        return PublicKey.from_id(public_id)
    except IdentityError:
        logger.debug("leaving a group member with the malformed id %.80r out of the report", public_id)
        return None
