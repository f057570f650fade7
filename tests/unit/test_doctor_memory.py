"""The doctor's memory verdicts on GPU machines it cannot run on here: the same estimate
(``protocol.footprint``) against given free memory (``swarmtrain.doctor.machine.memory``)."""

from __future__ import annotations

import pytest

from protocol.footprint import GIB
from protocol.spec import load_spec
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
        memory(LLAMA_1B, gpus(1, 79), host_bytes=16 * GIB)


def test_a_cpu_peer_needs_the_training_state_in_host_memory() -> None:
    with pytest.raises(CheckFailed, match="not enough memory for this model"):
        memory(LLAMA_1B, gpus(0, 0), host_bytes=32 * GIB)
    fit, _, _ = memory(load_spec("examples/demo.toml"), gpus(0, 0), host_bytes=4 * GIB)
    assert fit.footprint.total("device") == 0
