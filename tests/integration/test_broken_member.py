"""A member that fails mid all-reduce costs the others at most its own contribution (issue #14):
the round completes for the rest, their vectors are bit-identical, and the failed member's
range as a reducer is left out of the round (``stats["missing"]``) by every one of them.

Four real averagers on a real hivemind DHT; member 3 breaks in one way per test:
- ``garbage``: as a reducer it returns averaged parts that do not decode;
- ``silent``: as a reducer it takes every part and never answers;
- ``dies``: its averaging process exits after sending half its parts to a reducer (its
  sockets close: what a crash looks like to the others);
- ``nan-contribution``: its own contribution does not decode (NaN): it is left out as a
  sender everywhere, and its reducer still serves the others (nothing is missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from hivemind import DHT
from hivemind.averaging.partition import AllreduceException
from hivemind.proto import averaging_pb2, runtime_pb2

from engine.allreduce import CodecCompression, ExactAllReduceRunner
from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.outcome import GroupOutcome
from protocol.gathered import Gathered

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MEMBERS = 4
NUMEL = MEMBERS * 6 * 2**14
"""Several parts per reducer (each at least 64 KiB), so that "half its parts" means something."""


class GarbageReducer(ExactAllReduceRunner):
    async def _encode_once(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(buffer=b"\x7f" * 10, size=list(averaged.shape), dtype=self.codec.dtype_tag)


class SilentReducer(ExactAllReduceRunner):
    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for _ in stream:  # takes every part, answers none
            pass
        if False:  # pragma: no cover - an async generator that yields nothing
            yield averaging_pb2.AveragingData()


class DiesHalfway(ExactAllReduceRunner):
    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        half = max(1, self.tensor_part_container.num_parts_by_peer[peer_index] // 2)
        sent = 0
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            sent += 1
            if sent == half:
                os._exit(1)  # the averaging process dies mid all-reduce


class NaNContribution(CodecCompression):
    """Its own contribution does not decode (NaN): nobody, itself included, can count it."""

    def compress(self, tensor: torch.Tensor, info: Any, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        poisoned = tensor.detach().reshape(-1).clone()
        poisoned[::7] = float("nan")
        return runtime_pb2.Tensor(buffer=poisoned.numpy().tobytes(), size=list(tensor.shape), dtype=self.dtype_tag)


class FailsHere(ExactAllReduceRunner):
    """A local fault: its all-reduce raises here as soon as it begins."""

    async def run(self) -> AsyncIterator[torch.Tensor]:
        raise AllreduceException("a local fault: this member's all-reduce broke")
        yield torch.empty(0)  # pragma: no cover - makes this an async generator


BROKEN: dict[str, type[ExactAllReduceRunner] | type[CodecCompression]] = {
    "garbage": GarbageReducer,
    "silent": SilentReducer,
    "dies": DiesHalfway,
    "nan-contribution": NaNContribution,
}


def member_vector(index: int) -> torch.Tensor:
    return torch.full((NUMEL,), float(index + 1))


def run_group(
    broken: type[ExactAllReduceRunner] | type[CodecCompression], *, as_a_peer_does: bool = False
) -> list[dict[str, Any] | None]:
    """Each member's outcome (its vector and stats; None if its step raised). ``as_a_peer_does``:
    every member states what it starts from and may retry (``peer.swarm.swarm.Swarm.start_round``);
    the outcome then also holds the ``GroupOutcome`` itself."""
    codec = get_codec("none")
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [
        DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in range(MEMBERS - 1)
    ]
    averagers: list[ExactAverager] = []
    try:
        for i, dht in enumerate(dhts):
            # hivemind names RPC handlers after the class: the broken one must look like an ExactAverager
            runner = broken if i == 3 and issubclass(broken, ExactAllReduceRunner) else ExactAllReduceRunner
            cls = type("ExactAverager", (ExactAverager,), {"runner_class": runner})
            averager = cls(
                NUMEL,
                dht,
                codec=codec,
                prefix="brokenmember",
                start=False,
                min_group_size=MEMBERS,
                target_group_size=MEMBERS,
                min_matchmaking_time=4.0,
                request_timeout=3.0,
                allreduce_timeout=40.0,
                next_chunk_timeout=4.0,
            )
            if i == 3 and issubclass(broken, CodecCompression):
                averager.codec_compression = broken(codec)  # before the averager process starts
            averager.run_in_background(await_ready=True)
            with averager.get_tensors() as tensors:
                tensors[0].copy_(member_vector(i))
            averagers.append(averager)
        outcomes: list[dict[str, Any] | None] = [None] * MEMBERS

        def step(i: int) -> None:
            try:
                if as_a_peer_does:
                    gather = Gathered(id=f"m{i}", round=0, digest="d", samples=1).to_wire()
                    outcome = averagers[i].step(weight=1.0, timeout=30, gather=gather)
                else:
                    outcome = averagers[i].step(weight=1.0, timeout=30, allow_retries=False)
            except Exception:  # noqa: BLE001 - a failed step: no outcome
                return
            if outcome:
                with averagers[i].get_tensors() as tensors:
                    stats = dataclasses.asdict(outcome.stats)
                    outcomes[i] = {"vector": tensors[0].clone(), **stats, "outcome": outcome}

        threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(MEMBERS)]
        for thread in threads:
            thread.start()
        for thread in threads[:3]:  # the broken member may never return
            thread.join(timeout=120)
        return outcomes
    finally:
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_member_costs_the_others_only_its_own_contribution(broken: str) -> None:
    outcomes = run_group(BROKEN[broken])
    honest = outcomes[:3]
    assert all(o is not None for o in honest), f"the round failed for an honest member: {honest}"
    first = honest[0]
    assert first is not None
    missing = [tuple(r) for r in first["missing"]]
    if broken == "nan-contribution":
        for outcome in honest:
            assert outcome is not None and outcome["missing"] == []
            assert torch.equal(outcome["vector"], torch.full((NUMEL,), 2.0))  # (1 + 2 + 3) / 3 everywhere
            assert any("refused" in why for why in outcome["offences"].values()), outcome["offences"]
        return
    # the broken member's range as a reducer, and only that, is left out by every honest member
    assert len(missing) == 1, missing
    ((lo, hi),) = missing
    assert 0 < hi - lo < NUMEL / 2
    kept = torch.ones(NUMEL, dtype=torch.bool)
    kept[lo:hi] = False
    for outcome in honest:
        assert outcome is not None
        assert [tuple(r) for r in outcome["missing"]] == missing
        assert torch.equal(outcome["vector"][kept], first["vector"][kept])  # bit-identical where averaged
        assert any("reducer failed" in why for why in outcome["offences"].values()), outcome["offences"]
    averaged = first["vector"][kept]
    with_broken, without = (1 + 2 + 3 + 4) / 4, (1 + 2 + 3) / 3
    if broken == "dies":
        # its parts count where they arrived before it died, and nowhere else
        assert bool(((averaged == with_broken) | (averaged == without)).all())
    else:
        # as a sender it was honest: its parts count everywhere it was averaged
        assert bool((averaged == with_broken).all())


def test_a_member_whose_own_all_reduce_fails_ends_its_round_with_its_group_and_does_not_retry() -> None:
    """hivemind retries a failed step until its deadline; after a group's all-reduce began, a
    retry looks for a group at a round key the group has left (the others land without this
    member and move on), for up to the whole matchmaking timeout. The step ends at once
    instead, with the statements of the group it was in (``GroupOutcome.failed``): the peer
    knows which roster the state its group makes will have (``peer.round.roster_book``)."""
    outcomes = run_group(FailsHere, as_a_peer_does=True)
    mine = outcomes[3]
    assert mine is not None, "the failed member's step raised (it retried until its deadline)"
    outcome = mine["outcome"]
    assert isinstance(outcome, GroupOutcome) and "a local fault" in outcome.failed, outcome
    assert mine["missing"] == [(0, NUMEL)]
    assert sorted(g.id for g in outcome.gathered.values() if g is not None) == ["m0", "m1", "m2", "m3"]
