"""A token run's coordinator: data streams in joins and heartbeats; a report must say what it
read, from a stream its peer holds, never the same data round twice; the validation loss and
data epoch it shows come from granted reporters' lower median."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message
from tests.specs import TOKEN_RUN_SPEC
from tests.unit.conftest import new_core

SPEC = TOKEN_RUN_SPEC


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    made = new_core(tmp_path, SPEC)
    yield made
    made.store.close()


def join(core: Coordinator, peer: Identity, ranks: int = 1) -> pb.JoinResponse:
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    body.hardware.local_ranks = ranks
    return core.join(
        sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time()
    )


def report(core: Coordinator, peer: Identity, round_: int, data: pb.DataRead | None, **extra: object) -> str:
    extra.setdefault("group", [pb.GroupMember(public_key=peer.public_key.raw, weight=20.0)])
    body = pb.RoundReportBody(round=round_, samples=20, compute_s=5.0, state_digest="d", **extra)  # type: ignore[arg-type]
    if data is not None:
        body.data.CopyFrom(data)
    envelope = sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=time.time())
    try:
        return core.report_round(envelope.to_proto(), now=time.time()).reason
    except ValueError as exc:
        return f"refused: {exc}"


def read(round_: int, slot: int, steps: int = 5, epoch: float = 0.1) -> pb.DataRead:
    return pb.DataRead(round=round_, slot=slot, steps=steps, ids_digest="0" * 32, epoch=epoch)


def test_streams_in_joins_and_heartbeats_and_the_reports_checks(core: Coordinator) -> None:
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    assert join(core, a).data_slot == 0
    assert join(core, b, ranks=2).data_slot == 1  # streams 1 and 2
    with pytest.raises(Exception, match="all 3 data streams"):
        join(core, c)
    hb = core.heartbeat(
        sign_message(a, kinds.HEARTBEAT, pb.HeartbeatBody().SerializeToString(), now=time.time()).to_proto(),
        now=time.time(),
    )
    assert hb.HasField("data_slot") and hb.data_slot == 0

    assert "must say what it read" in report(core, a, 1, None)
    assert "holds [0]" in report(core, a, 1, read(0, 1))
    assert "a round has 5" in report(core, a, 1, read(0, 0, steps=6))
    assert "claims 20 samples but read 8" in report(core, a, 1, read(0, 0, steps=2))
    assert report(core, a, 1, read(0, 0)).startswith("pending")
    assert "reads data round 0 again" in report(core, a, 2, read(0, 0))
    assert report(core, b, 1, read(0, 2, steps=3)).startswith("pending")  # a node's second stream: 3·4·2 >= 20

    # a leaving heartbeat frees its streams at once
    core.heartbeat(
        sign_message(
            b, kinds.HEARTBEAT, pb.HeartbeatBody(phase=pb.PEER_PHASE_LEAVING).SerializeToString(), now=time.time()
        ).to_proto(),
        now=time.time(),
    )
    assert join(core, c).data_slot == 1


def test_shown_figures_are_the_lower_median_of_granted_reporters(core: Coordinator) -> None:
    peers = [Identity.generate() for _ in range(3)]
    for peer in peers:
        join(core, peer)
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=20.0) for p in peers]
    losses, epochs = [2.0, 2.1, 900.0], [0.2, 0.2, 1e9]  # the third one lies
    for i, peer in enumerate(peers):
        got = report(core, peer, 1, read(0, i, epoch=epochs[i]), validation_loss=losses[i], group=group)
        assert got.startswith("pending"), got
    core.tick(now=time.time() + 1)
    assert core.store.latest_validation().validation_loss == 2.1  # type: ignore[union-attr]
    assert core.data_epoch == 0.2
    progress = core.data_progress()
    assert progress is not None and progress.slots == 3 and progress.tokens_trained == 3 * 20 * 16
