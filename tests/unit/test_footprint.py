"""The doctor's memory estimate (``peer.node.footprint``) against what a real trainer holds:
every float32 storage alive after a round, plus the gradients during an inner step."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

from engine.codecs import get_codec
from engine.compression import RESIDUAL_DTYPE
from engine.outcome import AllReduceStats
from peer.node.footprint import LOSSY_CODECS, RESIDUAL_BYTES, estimate
from peer.round.swarm_port import RoundResult
from peer.round.trainer import Trainer, TrainerOptions
from peer.task import build_task
from protocol.spec import load_spec, parse_spec
from tests.specs import bare_spec
from tests.unit.recording_swarm import RecordingSwarm

SPEC = bare_spec(
    "footprint", d_model=256, n_layers=2, n_heads=4, context=16, batch_size=2, inner_steps=2,
    compression="{codec}", overlap="{overlap}", sections={"averaging": {"sync_fragments": 1}},
)  # fmt: skip
"""(The whole vector at once: the fragments in turn keep their one-fragment buffers only while a
round is in flight; ``benchmarks.scale --overlaps 4`` measures them.)"""
SCRATCH = 2 << 20
"""Chunk buffers of the host passes (``peer.round.state.CHUNK_VALUES``), not per parameter."""
AT_REST = ("gradients", "activations", "logits", "runtime", "CUDA context")
"""Items that are not allocated between rounds (or not by the trainer's own tensors)."""


def _float_storages() -> dict[int, torch.UntypedStorage]:
    """Every live float32 or bfloat16 (the codec residual) CPU tensor storage of this process,
    by address."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        if tensor.dtype not in (torch.float32, torch.bfloat16) or tensor.device.type != "cpu":
            continue
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except RuntimeError:  # a fake tensor a compiled test left alive: it allocates nothing
            continue
        if address:
            storages[address] = storage
    return storages


@pytest.mark.parametrize(("codec", "overlap"), [("int8", False), ("int8", True), ("none", False)])
def test_the_estimate_matches_what_a_trainer_allocates(codec: str, overlap: bool) -> None:
    spec = parse_spec(SPEC.format(codec=codec, overlap=str(overlap).lower()))
    # what other tests of this process left alive is not the trainer's (held, so that no
    # storage of the trainer can reuse one of their addresses)
    before = _float_storages()
    swarm = RecordingSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=2))  # type: ignore[arg-type]
    n = trainer.state.params.numel()
    swarm.vector = torch.full((n,), float("nan"))
    swarm.next_result = RoundResult(torch.full((n,), 1e-3), 2, [], AllReduceStats(10, 10), 0.0)
    grads: list[int] = []
    held: set[int] = set()  # the storages the gradients were in

    def before_step(opt: Any, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grads.append(sum(p.grad.nbytes for p in params))
        held.update(p.grad.untyped_storage().data_ptr() for p in params)

    trainer.optimizer.register_step_pre_hook(before_step)
    trainer.run()
    assert trainer.history[-1].averaged
    # the fake swarm's tensors: the averager's vector (counted under shm), what it recorded
    skip = {swarm.vector.untyped_storage().data_ptr(), swarm.next_result.averaged.untyped_storage().data_ptr()}
    skip |= {vector.untyped_storage().data_ptr() for vector, _ in swarm.launched}
    skip |= set(before)
    measured = sum(storage.nbytes() for ptr, storage in _float_storages().items() if ptr not in skip)

    footprint = estimate(spec, accelerator=False)
    expected = sum(i.bytes for i in footprint.items if i.where != "shm" and i.name not in AT_REST)
    assert abs(measured - expected) <= 0.03 * expected + SCRATCH, (measured / n, expected / n)
    assert max(grads) == next(i.bytes for i in footprint.items if i.name == "gradients") == 4 * n
    assert footprint.total("shm") == 4 * n  # the averager's one fp32 vector, the gradients in it
    # they lived in the vector: views of it, no memory of their own (``peer.round.grad_home``)
    assert all(p.grad is None for p in trainer.model.parameters())  # dropped at the launch
    in_vector = swarm.vector.untyped_storage().data_ptr() in held
    assert in_vector == (not overlap) == (next(i.where for i in footprint.items if i.name == "gradients") == "shm")


def test_lossy_codecs_are_the_ones_with_a_residual() -> None:
    for name in ("none", "fp16", "int8", "4bit", "sparse"):
        assert get_codec(name).lossy == (name in LOSSY_CODECS)
    assert torch.empty(0, dtype=RESIDUAL_DTYPE).element_size() == RESIDUAL_BYTES


def test_a_1b_model_needs_tens_of_gib_and_sharding_divides_the_device_share() -> None:
    spec = load_spec("examples/llama-1b.toml")
    one = estimate(spec, accelerator=True)
    assert one.params == 1_235_814_400
    assert 16 * one.params < one.total("device") < 16 * one.params + 12 * 2**30
    assert one.total("shm") == 4 * one.params
    sharded = estimate(spec, accelerator=True, local_ranks=8, sharded=True)
    assert sharded.total("device") < one.total("device") / 2
    assert sharded.total("host") == one.total("host") + 4 * one.params  # the leader's full copy
    cpu = estimate(spec, accelerator=False)
    assert cpu.total("device") == 0 and cpu.total("host") > one.total("host") + 16 * one.params


H200_RESULTS = {  # benchmarks/results/lm-throughput-2026-11-25-h200-llama-1b*.json: torch's allocator peak
    (4, True): "-mb4-ckpton",
    (2, True): "-mb2-ckpton",
    (2, False): "-mb2-ckptoff",
    (1, False): "-mb1-ckptoff",
}


@pytest.mark.parametrize(("micro_batches", "checkpointing"), sorted(H200_RESULTS))
def test_the_gpu_estimate_covers_what_an_h200_allocated(micro_batches: int, checkpointing: bool) -> None:
    """examples/llama-1b.toml measured on an H200 (issue #29; eager blocks, the chunked loss
    head) at four micro-batch/checkpointing settings, 25 to 52 GiB: the estimate (without the
    CUDA context, which torch's allocator does not count) is at least the measured peak and at
    most 10% over it."""
    import json
    from pathlib import Path

    from peer.node.footprint import GIB
    from protocol.spec import local_compute

    name = f"lm-throughput-2026-11-25-h200-llama-1b{H200_RESULTS[(micro_batches, checkpointing)]}.json"
    measured = json.loads((Path("benchmarks/results") / name).read_text())
    assert (measured["micro_batches"], measured["activation_checkpointing"]) == (micro_batches, checkpointing)
    assert not measured["compile"]
    spec = local_compute(load_spec("examples/llama-1b.toml"), micro_batches=micro_batches, checkpointing=checkpointing)
    footprint = estimate(spec, accelerator=True)
    context = next(i.bytes for i in footprint.items if i.name == "CUDA context")
    estimated = (footprint.total("device") - context) / GIB
    assert measured["peak_gpu_gib"] <= estimated <= 1.10 * measured["peak_gpu_gib"]
