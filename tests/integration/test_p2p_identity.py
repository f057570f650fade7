"""A peer's libp2p identity is Ed25519, as the daemon's own would be: hivemind, given an identity
file to create, writes an RSA-2048 key, whose every handshake signature costs about 10 times more
(``engine.p2p_identity``). A real swarm node:
its DHT and its averager answer as the same Ed25519 peer id (libp2p's ``12D3KooW`` ids are an
Ed25519 public key inlined; an RSA key's are a hash, ``Qm``)."""

from __future__ import annotations

from engine.codecs import get_codec
from peer.swarm.swarm import Swarm
from protocol.spec import parse_spec
from tests.specs import tiny_spec

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_a_swarm_node_s_libp2p_identity_is_ed25519() -> None:
    spec = parse_spec(tiny_spec("identity", context=16, inner_steps=2))
    swarm = Swarm(spec, 1024, get_codec(spec.averaging.compression), initial_peers=[], host_maddrs=LOOPBACK)
    try:
        peer_id = swarm.dht.peer_id
        assert peer_id.to_base58().startswith("12D3KooW"), f"{peer_id} is not an Ed25519 identity"
        assert swarm.averager.peer_id == peer_id
    finally:
        swarm.shutdown()
