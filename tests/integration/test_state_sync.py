"""Late join: a newcomer downloads the swarm's state from peers and verifies its digest;
a peer serving tampered state is refused."""

from __future__ import annotations

import threading

import torch

from engine.codecs import get_codec
from peer.round.trainer import Trainer, TrainerOptions
from peer.swarm.swarm import Swarm
from peer.task import build_task
from protocol.spec import parse_spec
from tests.specs import tiny_spec

SPEC = tiny_spec("sync", context=16, inner_steps=2)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_newcomer_downloads_verified_state_and_refuses_tampered() -> None:
    spec = parse_spec(SPEC)
    codec = get_codec(spec.averaging.compression)
    numel = sum(p.numel() for p in build_task(spec, shard_seed=0).model.parameters())
    swarms = [Swarm(spec, numel, codec, initial_peers=[], host_maddrs=LOOPBACK)]
    maddrs = swarms[0].visible_maddrs
    swarms.append(Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK))
    try:
        trainers = [
            Trainer(spec, build_task(spec, shard_seed=i), swarm, TrainerOptions(max_rounds=3))
            for i, swarm in enumerate(swarms)
        ]
        threads = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in threads)
        a, b = trainers
        assert a.state.digest() == b.state.digest() and a.state.round == 3

        # a liar serves tampered parameters under the honest metadata; honest peers stop serving
        liar = Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK)
        swarms.append(liar)
        tampered = a.state.params.clone()
        tampered[0] += 1e-3
        liar.averager.state_provider = lambda take: take(3, tampered, a.state.momentum, a.state.digest())
        # another sends far more bytes than the state can have (refused once over the size)
        hog = Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK)
        swarms.append(hog)
        huge = torch.zeros(numel * 8)
        hog.averager.state_provider = lambda take: take(3, huge, huge, a.state.digest())
        for swarm in swarms[:2]:
            swarm.averager.allow_state_sharing = False

        newcomer_swarm = Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK)
        swarms.append(newcomer_swarm)
        # this test is about verifying downloads: the newcomer believes a and b as if it had
        # averaged with them (how an open run's newcomer learns whom to believe is in
        # test_forged_state.py)
        assert newcomer_swarm.accepted_state() is None
        newcomer_swarm.electorate |= {a.identity.public_key.id, b.identity.public_key.id}
        accepted = newcomer_swarm.accepted_state()
        assert accepted is not None and (accepted.round, accepted.digest) == (3, a.state.digest())
        assert newcomer_swarm.download_state({accepted.digest}, timeout=10) is None

        swarms[0].averager.allow_state_sharing = True
        newcomer = Trainer(spec, build_task(spec, shard_seed=9), newcomer_swarm, TrainerOptions(max_rounds=1))
        assert newcomer.state.round == 0
        assert newcomer.catch_up()
        assert newcomer.state.round == 3 and newcomer.state.digest() == a.state.digest()
        assert torch.equal(newcomer.state.params, a.state.params)
    finally:
        for swarm in swarms:
            swarm.shutdown()
