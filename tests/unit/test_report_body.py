"""The round report a peer sends (``peer.link.coordinator_client.report_body``): built from the
typed round record, with what other members stated bounded before it goes on the wire."""

from __future__ import annotations

import math
from dataclasses import replace

from peer.link.report_wire import report_body
from peer.task.data_assignment import DataRead
from protocol.identity import Identity
from protocol.messages import MAX_REPORTED_SAMPLES
from tests.unit.round_rows import row


def test_a_member_that_stated_no_public_id_is_left_out_and_the_report_still_goes() -> None:
    a, b = Identity.generate(), Identity.generate()
    metrics = row(3, averaged=True, digest="d3", members=[a, b])
    liar = replace(metrics.members[1], id="ed25519:not-a-key")
    body = report_body(replace(metrics, members=[metrics.members[0], liar]))
    assert [m.public_key for m in body.group] == [a.public_key.raw]


def test_members_claims_are_bounded_and_the_data_read_is_carried() -> None:
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    metrics = row(3, averaged=True, digest="d3", members=[a, b, c], val_loss=math.inf)
    members = [
        replace(metrics.members[0], samples=1e15),
        replace(metrics.members[1], samples=math.nan),
        replace(metrics.members[2], samples=-5),
    ]
    read = DataRead(round=3, slot=1, steps=4, ids_digest="ab" * 16, epoch=0.5)
    body = report_body(replace(metrics, members=members, data=read))
    assert [m.weight for m in body.group] == [float(MAX_REPORTED_SAMPLES), 0.0, 0.0]
    assert not body.HasField("validation_loss")
    assert (body.data.round, body.data.slot, body.data.steps, body.data.ids_digest) == (3, 1, 4, "ab" * 16)


def test_every_field_of_the_report_comes_from_the_round_record() -> None:
    """A figure added to the report needs its twin in ``RoundMetrics`` (of the same name) and
    nothing else on the way to the wire: each scalar the report carries is the record's."""
    import dataclasses

    from peer.link.report_wire import _NAMED
    from peer.round.round_metrics import RoundMetrics

    fields = {f.name for f in dataclasses.fields(RoundMetrics)}
    assert _NAMED and all(field.name in fields for field in _NAMED), [f.name for f in _NAMED]


def test_figures_are_carried_by_name_and_bounded_for_the_wire() -> None:
    a, b = Identity.generate(), Identity.generate()
    metrics = replace(
        row(3, averaged=True, digest="d3", members=[a, b]),
        loss=math.inf, wait_s=-1.0, allreduce_s=math.nan, host_s=0.25, bytes_sent=7, bytes_received=9,
    )  # fmt: skip
    body = report_body(metrics)
    assert (body.round, body.state_digest, body.bytes_sent, body.bytes_received) == (3, "d3", 7, 9)
    assert math.isnan(body.loss) and body.wait_s == 0.0 and body.allreduce_s == 0.0 and body.host_s == 0.25
