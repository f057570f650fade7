"""The doctor's memory verdicts on GPU machines it cannot run on here: the same estimate
(``peer.node.footprint``) against given free memory (``swarmtrain.doctor.machine.memory``)."""

from __future__ import annotations

import pytest

from peer.node.footprint import GIB
from protocol.spec import load_spec, local_compute
from swarmtrain.doctor.machine import Accelerator, memory
from swarmtrain.doctor.verdict import CheckFailed

LLAMA_1B = load_spec("examples/llama-1b.toml")


def gpus(count: int, free_gib: float) -> Accelerator:
    return Accelerator(count, ["GPU"] * count, [int(free_gib * GIB)] * count, True, "2.27.3" if count else None)


def test_a_1b_model_fits_an_80gb_gpu_as_a_replica() -> None:
    fit, detail, data = memory(LLAMA_1B, gpus(1, 79), host_bytes=64 * GIB)
    assert not fit.sharded and "per GPU" in detail and data["params"] == 1_235_814_400


def test_too_small_for_one_gpu_is_sharded_over_several() -> None:
    fit, detail, _ = memory(LLAMA_1B, gpus(8, 16), host_bytes=128 * GIB)
    assert fit.sharded and "sharded over 8 GPUs" in detail


def test_one_small_gpu_fails_naming_the_need_and_the_fix() -> None:
    with pytest.raises(CheckFailed) as failed:
        memory(LLAMA_1B, gpus(1, 16), host_bytes=128 * GIB)
    assert "not enough GPU memory" in failed.value.detail and "16.0 GiB free" in failed.value.detail
    assert "more GPUs" in failed.value.fix


def test_host_memory_is_checked_on_gpu_machines_too() -> None:
    with pytest.raises(CheckFailed, match="of host memory"):
        memory(LLAMA_1B, gpus(1, 79), host_bytes=8 * GIB)


def test_a_cpu_peer_needs_the_training_state_in_host_memory() -> None:
    with pytest.raises(CheckFailed, match="not enough memory for this model"):
        memory(LLAMA_1B, gpus(0, 0), host_bytes=32 * GIB)
    fit, _, _ = memory(load_spec("examples/demo.toml"), gpus(0, 0), host_bytes=4 * GIB)
    assert fit.footprint.total("device") == 0


def test_an_80gb_gpu_is_told_the_faster_plan_that_fits_it() -> None:
    """llama-1b's spec (4 micro-batches, checkpointing on, eager) fits an 80 GB GPU with room to
    spare; the doctor names the likely faster flags that still fit (an H200 measured 62,944
    tokens/s, 52% MFU, with 1 micro-batch, no checkpointing and compiled blocks against 32,211
    as written, at 39.2 GiB)."""
    fastest = "--micro-batches 1 --activation-checkpointing off --compile on"
    _, detail, _ = memory(LLAMA_1B, gpus(1, 79), host_bytes=64 * GIB)
    assert f"likely faster on this GPU: `swarmtrain peer ... {fastest}`" in detail
    _, detail, _ = memory(LLAMA_1B, gpus(1, 50), host_bytes=64 * GIB)
    assert "likely faster on this GPU: `swarmtrain peer ... --micro-batches 2 --activation-checkpointing off" in detail
    _, detail, _ = memory(LLAMA_1B, gpus(1, 30), host_bytes=64 * GIB)  # checkpointing still: compiled
    assert "--activation-checkpointing on --compile on" in detail
    compiled = local_compute(LLAMA_1B, compile_blocks=True)
    _, detail, _ = memory(compiled, gpus(1, 29), host_bytes=64 * GIB)
    assert "likely faster" not in detail  # nothing faster than the spec's fits 90% of 29 GiB


def test_a_gpu_too_small_for_the_runs_plan_is_told_the_plan_that_fits() -> None:
    greedy = local_compute(LLAMA_1B, micro_batches=1, checkpointing=False)  # ~73 GiB
    with pytest.raises(CheckFailed) as failed:
        memory(greedy, gpus(1, 40), host_bytes=64 * GIB)
    assert "not enough GPU memory for this run's micro-batches and checkpointing" in failed.value.detail
    assert "run the peer with `--micro-batches" in failed.value.fix


def test_plans_fastest_first_and_only_for_causal_lm_runs() -> None:
    from swarmtrain.doctor.machine import plans

    order = [(p.micro_batches, p.checkpointing) for p in plans(LLAMA_1B)]
    assert order == [(1, False), (2, False), (4, False), (8, False), (1, True), (2, True), (4, True), (8, True)]
    assert all(p.compile for p in plans(LLAMA_1B))
    sizes = [p.device_bytes for p in plans(LLAMA_1B)]
    assert sizes[:4] == sorted(sizes[:4], reverse=True) and sizes[4:] == sorted(sizes[4:], reverse=True)
    assert plans(load_spec("examples/demo.toml")) == []
