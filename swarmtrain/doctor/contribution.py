"""What this machine would contribute to a run: its measured inner-step speed on the run's
model, less the time averaging takes at the measured bandwidth (hidden behind the next
round's inner steps when the run overlaps them), as samples and credited FLOPs per hour."""

from __future__ import annotations

from typing import Any

from protocol.modelsize import task_flops_per_sample
from protocol.spec import RunSpec
from swarmtrain.doctor.verdict import CheckFailed

MEASURE_STEPS = 5
MEASURE_BUDGET_S = 15.0


def expected(
    spec: RunSpec, *, device: str, params: int, upload_bits_per_s: float | None, gpus: int = 1
) -> tuple[str, dict[str, Any]]:
    from peer.node.throughput import measure

    try:
        speed = measure(spec, device=device, steps=MEASURE_STEPS, warmup=1, budget_s=MEASURE_BUDGET_S)
    except Exception as exc:
        raise CheckFailed(
            f"the run's inner step failed here: {type(exc).__name__}: {str(exc)[:200]}",
            "see the memory check above; smaller micro-batches or activation_checkpointing in the spec",
        ) from exc
    samples_per_s = speed.samples_per_s * max(1, gpus)  # data-parallel ranks each train their own batches
    step_s = spec.inner.batch_size / samples_per_s
    inner = spec.rounds.inner_steps
    compute_s = step_s * inner if inner else float(spec.rounds.time_budget_s or 0)
    round_samples = samples_per_s * compute_s
    comm_s = None
    if upload_bits_per_s:
        # a butterfly all-reduce of n members sends 2(n-1)/n of the vector from each (its parts
        # to the other reducers, then its averaged part back to them): upload-bound; a round's
        # group is the whole swarm, so count the large-n bound, twice the vector
        sent = 2 * params * spec.averaging.wire_bytes_per_value()
        comm_s = 8 * sent / upload_bits_per_s
    round_s = (
        compute_s if comm_s is None else (max(compute_s, comm_s) if spec.averaging.overlap else compute_s + comm_s)
    )
    per_hour = 3600 * round_samples / max(round_s, 1e-9)
    flops = per_hour * task_flops_per_sample(spec)
    data = {
        "samples_per_s": samples_per_s,
        "tokens_per_s": speed.tokens_per_s * max(1, gpus),
        "precision": speed.precision,
        "round_compute_s": compute_s,
        "round_comm_s": comm_s,
        "samples_per_hour": per_hour,
        "credited_flops_per_hour": flops,
    }
    comm = f", averaging ~{comm_s:.1f} s/round at the measured upload" if comm_s is not None else ""
    return (
        f"~{per_hour:,.0f} samples/hour, ~{flops:.2e} FLOPs/hour of credit "
        f"({samples_per_s:.1f} samples/s measured, {speed.precision}{comm}; an estimate: "
        "credit needs attestation by the peer's group)",
        data,
    )
