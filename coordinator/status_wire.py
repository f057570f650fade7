"""The swarm's snapshot on the wire: what the gRPC ``Status`` call answers (``swarmtrain status``),
mapped in this one place from ``coordinator.snapshot.SwarmSnapshot``."""

from __future__ import annotations

import dataclasses

from coordinator.round_view import RoundFigures
from coordinator.snapshot import SwarmSnapshot
from protocol import coordinator_pb2 as pb
from protocol.identity import PublicKey


def status_response(snap: SwarmSnapshot) -> pb.StatusResponse:
    """The swarm's snapshot as the gRPC ``Status`` call answers it (``swarmtrain status``)."""
    evaluated, data = snap.evaluated, snap.data
    return pb.StatusResponse(
        validation_loss=evaluated.validation_loss if evaluated else None,
        validation_round=evaluated.round if evaluated else 0,
        data=pb.DataProgress(**dataclasses.asdict(data)) if data is not None else None,
        run_name=snap.run_name,
        spec_digest=snap.spec_digest,
        current_round=snap.current_round,
        current_state_digest=snap.current_state_digest,
        peers_online=snap.peers_online,
        samples_per_second=snap.samples_per_second,
        rounds_per_hour=snap.rounds_per_hour,
        last_round_time=snap.latest.finalized_at if snap.latest else 0.0,
        rounds=[_round_view(f) for f in snap.rounds],
        peers=[
            pb.PeerStatus(
                public_key=PublicKey.from_id(p.key).raw,
                libp2p_peer_id=p.libp2p_peer_id,
                state=p.state.value,
                samples_per_second=p.samples_per_second,
                reachable=p.reachable,
                software_version=p.software_version,
                last_seen=p.last_seen,
                local_ranks=p.local_ranks,
                network_path=p.network_path,
                punched_peers=p.punched_peers,
            )
            for p in snap.peers
        ],
    )


def _round_view(figures: RoundFigures) -> pb.RoundView:
    return pb.RoundView(
        round=figures.round,
        groups=figures.groups,
        states=figures.states,
        peers_averaged=figures.peers_averaged,
        reports=figures.reports,
        decided=figures.decided,
    )
