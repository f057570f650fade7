"""A peer whose model goes non-finite mid-run drops its local work, reloads θ_g, resets its
inner optimizer, claims no samples for that round and stays bit-identical with the swarm."""

from __future__ import annotations

import threading
from typing import Any

import torch

from engine.codecs import get_codec
from peer.round.trainer import Trainer, TrainerOptions
from peer.swarm.swarm import Swarm
from peer.task import build_task
from protocol.spec import parse_spec
from tests.specs import tiny_spec

SPEC = tiny_spec("nan", context=16, inner_steps=2)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
ROUNDS = 4
POISONED_CALL = 3  # the first inner step of this peer's second round


def test_a_peer_driven_to_nan_recovers_within_one_round() -> None:
    spec = parse_spec(SPEC)
    codec = get_codec(spec.averaging.compression)
    numel = sum(p.numel() for p in build_task(spec, shard_seed=0).model.parameters())
    swarms = [Swarm(spec, numel, codec, initial_peers=[], host_maddrs=LOOPBACK)]
    swarms.append(Swarm(spec, numel, codec, initial_peers=swarms[0].visible_maddrs, host_maddrs=LOOPBACK))
    try:
        tasks = [build_task(spec, shard_seed=i) for i in range(2)]
        loss_fn, calls = tasks[1].loss_fn, [0]

        def diverging_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == POISONED_CALL:  # a blow-up: the weights are NaN from here on
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
            return loss_fn(model, batch)

        tasks[1].loss_fn = diverging_loss
        trainers = [Trainer(spec, task, swarm, TrainerOptions(max_rounds=ROUNDS)) for task, swarm in zip(tasks, swarms)]
        threads = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(thread.is_alive() for thread in threads)
        healthy, sick = ([m.as_dict() for m in t.history] for t in trainers)
        assert len(sick) == ROUNDS and len(healthy) == ROUNDS
        bad = sick[1]
        assert bad["samples"] == 0, bad  # claims nothing for the round its model went NaN
        assert all(row["samples"] > 0 for i, row in enumerate(sick) if i != 1)
        # it took part (with zeros) and holds the swarm's state right after that round
        healthy_by_round = {row["round"]: row["state_digest"] for row in healthy if row["averaged"]}
        after = [row for row in sick[1:] if row["averaged"]]
        assert after and all(healthy_by_round.get(row["round"]) == row["state_digest"] for row in after), (
            sick,
            healthy,
        )
        assert trainers[0].state.digest() == trainers[1].state.digest()
        assert all(bool(torch.isfinite(p).all()) for p in trainers[1].model.parameters())
    finally:
        for swarm in swarms:
            swarm.shutdown()
