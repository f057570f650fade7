"""The round report a peer sends (``peer.link.coordinator_client.report_body``): built from the
typed round record, with what other members stated bounded before it goes on the wire."""

from __future__ import annotations

import math
from dataclasses import replace

from peer.link.coordinator_client import report_body
from peer.task.data_assignment import DataRead
from protocol.identity import Identity
from protocol.messages import MAX_REPORTED_SAMPLES
from tests.unit.test_metrics_exposition import row


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
