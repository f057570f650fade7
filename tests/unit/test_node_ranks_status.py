"""A node's local ranks, as it says when it joins, reach the coordinator's status (clamped)."""

from __future__ import annotations

import time

import pytest

from coordinator.core import MAX_LOCAL_RANKS, Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.identity import Identity
from protocol.messages import sign_message


def _join(core: Coordinator, local_ranks: int) -> str:
    peer = Identity.generate()
    body = pb.JoinBody(
        libp2p_peer_id="p", software_version="t", spec_digest=core.digest, hardware=pb.Hardware(local_ranks=local_ranks)
    )
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time())
    return peer.public_key.id


@pytest.mark.parametrize(("said", "shown"), [(0, 1), (1, 1), (8, 8), (-3, 1), (10**6, MAX_LOCAL_RANKS)])
def test_status_shows_the_local_ranks_a_node_joined_with(core: Coordinator, said: int, shown: int) -> None:
    _join(core, said)
    (peer,) = core.status(now=time.time()).peers
    assert peer.local_ranks == shown
    (row,) = core.store.peers()
    assert f'"local_ranks": {shown}' in row.hardware_json
