"""What a peer says of how it is reached (its join's network_path, its heartbeats' count of
hole-punched connections) is checked, kept with its health, and shown in the gRPC status and
/metrics; anything else is refused and changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from coordinator.http.metrics import render_metrics
from coordinator.store import Store, sqlite_url
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import MalformedMessageError
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.spec import parse_spec

SPEC = '[run]\nname = "paths"\n'


def _join(core: Coordinator, peer: Identity, path: str) -> None:
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest, network_path=path)
    now = time.time()
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)


def test_each_peers_path_is_in_the_status_and_the_metrics(tmp_path: Path) -> None:
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    try:
        for path in ("relayed", "relayed", "announced", ""):
            _join(core, Identity.generate(), path)
        shown = sorted(p.network_path for p in core.status(now=time.time()).peers)
        assert shown == ["", "announced", "relayed", "relayed"]
        text = render_metrics(core, now=time.time())
        assert 'swarmtrain_peers_by_network_path{path="relayed"} 2.0' in text
        assert 'swarmtrain_peers_by_network_path{path="unknown"} 1.0' in text
        assert 'swarmtrain_peers_by_network_path{path="direct"} 0.0' in text
    finally:
        store.close()


@pytest.mark.parametrize("path", ["hole-punched", "RELAYED", "direct\x00", "x" * 5000])
def test_a_join_with_an_unknown_path_is_refused_and_changes_nothing(tmp_path: Path, path: str) -> None:
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    try:
        with pytest.raises(MalformedMessageError, match="network_path"):
            _join(core, Identity.generate(), path)
        assert not core.status(now=time.time()).peers and not store.peers()
    finally:
        store.close()


def _beat(core: Coordinator, peer: Identity, punched: int) -> None:
    body = pb.HeartbeatBody(round=1, phase=pb.PEER_PHASE_TRAINING, punched_peers=punched)
    now = time.time()
    core.heartbeat(sign_message(peer, kinds.HEARTBEAT, body.SerializeToString(), now=now).to_proto(), now=now)


def test_hole_punched_connections_are_counted_in_the_status_and_the_metrics(tmp_path: Path) -> None:
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    try:
        peers = [Identity.generate() for _ in range(3)]
        for peer, punched in zip(peers, (2, 1, 1), strict=True):
            _join(core, peer, "relayed")
            _beat(core, peer, punched)
        assert sorted(p.punched_peers for p in core.status(now=time.time()).peers) == [1, 1, 2]
        assert "swarmtrain_hole_punched_connections 4.0" in render_metrics(core, now=time.time())
    finally:
        store.close()


@pytest.mark.parametrize("punched", [-1, 100_001])
def test_a_heartbeat_with_an_impossible_punched_count_is_refused_and_changes_nothing(
    tmp_path: Path, punched: int
) -> None:
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    try:
        peer = Identity.generate()
        _join(core, peer, "relayed")
        _beat(core, peer, 3)
        with pytest.raises(MalformedMessageError, match="punched_peers"):
            _beat(core, peer, punched)
        assert [p.punched_peers for p in core.status(now=time.time()).peers] == [3]
    finally:
        store.close()
