"""A peer's recorded rounds for the coordinator's tests: a joined peer, a round's row
(``RoundMetrics``), the link that reports it and the reports it sends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.core import Coordinator
from peer.link.coordinator_client import JoinAs
from peer.link.coordinator_link import CoordinatorLink
from peer.round.round_metrics import RoundMetrics
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.gathered import Gathered
from protocol.identity import Identity
from protocol.messages import sign_message


def signed(peer: Identity, kind: str, body: Any, now: float) -> pb.SignedEnvelope:
    return sign_message(peer, kind, body.SerializeToString(), now=now).to_proto()


T0 = 1_000_000.0


def joined(core: Coordinator, now: float = T0) -> Identity:
    peer = Identity.generate()
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(signed(peer, kinds.JOIN, body, now), now=now)
    return peer


def row(round_: int, *, averaged: bool, digest: str, members: Sequence[Identity] = (), **figures: Any) -> RoundMetrics:
    """A trainer's round (``RoundMetrics``), as ``CoordinatorLink.report`` gets it."""
    values: dict[str, Any] = dict(
        round=round_,
        group_size=len(members) or 1,
        samples=20 if averaged else 0,
        loss=2.5,
        state_digest=digest,
        bytes_sent=0,
        bytes_received=0,
        compute_s=5.0,
        wait_s=0.0,
        wall_s=5.0,
        in_sync=True,
        averaged=averaged,
        params=10,
        allreduce_s=0.0,
        matchmaking_timeout_s=10.0,
        allreduce_timeout_s=10.0,
        members=[Gathered(id=m.public_key.id, round=round_ - 1, samples=20, digest="d0") for m in members],
    )
    values.update(figures)
    return RoundMetrics(**values)


def link() -> CoordinatorLink:
    return CoordinatorLink(object(), interval_s=5.0, rejoin=JoinAs())  # type: ignore[arg-type]


def send_reports(core: Coordinator, peer: Identity, peer_link: CoordinatorLink, now: float) -> None:
    while (body := peer_link.outbox.first()) is not None:
        core.report_round(signed(peer, kinds.ROUND_REPORT, body, now), now=now)
        peer_link.outbox.done(body)
