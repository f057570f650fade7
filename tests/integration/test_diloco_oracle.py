"""Correctness oracle: 2 real peers (hivemind DHT + exact all-reduce) with H=1, no
compression, plain inner SGD and outer SGD lr 1.0 without momentum must produce the same
parameters as one process doing SGD on the average of both peers' gradients. (Robust
averaging off: in a group of two it bounds both members by the smaller norm, by design.)"""

from __future__ import annotations

import threading

import torch

from engine.codecs import get_codec
from peer.round.state import flatten, load_flat
from peer.round.trainer import Trainer, TrainerOptions
from peer.swarm.swarm import Swarm
from peer.task import build_task
from protocol.spec import parse_spec
from tests.specs import tiny_spec

SPEC = tiny_spec(
    "oracle",
    context=16,
    lr=0.5,
    inner_steps=1,
    compression="none",
    sections={
        "inner": {"optimizer": '"sgd"', "weight_decay": 0.0, "grad_clip": 0.0},
        "outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
        "averaging": {"error_feedback": False, "robust": False},
    },
)
ROUNDS = 3
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def reference(spec, seeds: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    tasks = [build_task(spec, shard_seed=s) for s in seeds]
    model = tasks[0].model
    for _ in range(ROUNDS):
        grads = []
        for task in tasks:
            model.zero_grad(set_to_none=True)
            task.loss_fn(model, next(task.batches)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        mean = torch.stack(grads).mean(0)
        load_flat(model, flatten(model) - spec.inner.lr * mean)
    return flatten(model)


def test_two_peers_h1_equal_data_parallel_sgd() -> None:
    spec = parse_spec(SPEC)
    seeds = [11, 22]
    codec = get_codec("none")
    numel = sum(p.numel() for p in build_task(spec, shard_seed=0).model.parameters())
    first = Swarm(spec, numel, codec, initial_peers=[], host_maddrs=LOOPBACK)
    second = Swarm(spec, numel, codec, initial_peers=first.visible_maddrs, host_maddrs=LOOPBACK)
    trainers = [
        Trainer(spec, build_task(spec, shard_seed=seed), swarm, TrainerOptions(max_rounds=ROUNDS))
        for seed, swarm in zip(seeds, [first, second])
    ]
    try:
        threads = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(thread.is_alive() for thread in threads), "peers did not finish"
    finally:
        for trainer in trainers:
            trainer.options.stop.set()
        first.shutdown()
        second.shutdown()
    for trainer in trainers:
        assert [m.group_size for m in trainer.history] == [2] * ROUNDS, trainer.history
    a, b = (t.state for t in trainers)
    assert a.digest() == b.digest() and torch.equal(a.params, b.params)
    expected = reference(spec, seeds)
    assert torch.allclose(a.params, expected, rtol=1e-5, atol=1e-6), (a.params - expected).abs().max()
