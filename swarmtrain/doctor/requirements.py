"""What one peer of a run needs, from the spec alone: GPU memory, host RAM, ``/dev/shm``, disk,
and the bytes it moves per round and per day (``swarmtrain doctor --requirements``).

Memory is ``peer.node.footprint``'s estimate at the spec's own compute settings (its micro-batches
and activation checkpointing; a peer may choose others). The link figures count what a member
sends and receives in a butterfly all-reduce at the large-group bound (2·S each way, S the
pseudo-gradient's bytes in the run's codec), a join's state download (θ_g and the outer
momentum, 8 bytes a value) and, in a token run, the shard bytes its data stream reads. Disk is
the peer's checkpoints (``Checkpointer`` keeps 2; each holds θ_g, the momentum, the model, the
inner optimizer and the codec residual), the averaged updates it keeps for newcomers
(``--keep-updates``, 16 rounds, at most ``engine.update_store.KEPT_BYTES``) and, in a token run,
one day of its stream's shards. Per day means one round every ``round_s`` seconds: the spec's
time budget unless the caller says otherwise (a GPU that finishes H steps sooner averages more
often, and every per-day figure grows with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.node.footprint import FP32, LOSSY_CODECS, RESIDUAL_BYTES, estimate, gib
from protocol.manifest import ITEMSIZE, dtype_for_vocab
from protocol.modelsize import VOCAB_SIZE, task_params
from protocol.spec import RunSpec

DAY_S = 86_400.0
KEPT_ROUNDS = 16
"""``swarmtrain peer --keep-updates``'s default."""
KEPT_BYTES = 4 << 30
"""``engine.update_store.KEPT_BYTES`` (torch-free here; a test checks they agree)."""
CHECKPOINTS_KEPT = 2
"""``engine.checkpoint.Checkpointer``'s default ``keep`` (a test checks they agree)."""
GB = 1e9


@dataclass(frozen=True)
class Requirements:
    """One peer's needs for a run (bytes, and seconds per round)."""

    params: int
    gpu_bytes: int
    """Per GPU, training on a GPU with the spec's compute settings."""
    host_bytes: int
    """Host RAM of a GPU peer (the leader's process)."""
    cpu_host_bytes: int
    """Host RAM of a CPU peer (the model trains in host memory)."""
    shm_bytes: int
    disk_bytes: int
    up_per_round: float
    down_per_round: float
    data_per_round: float
    """Token shards read per round (0 when the data is on every machine)."""
    join_bytes: float
    round_s: float | None
    """Seconds per round the per-day figures assume (None: only per round)."""

    def per_day(self, per_round: float) -> float | None:
        return None if self.round_s is None else per_round * DAY_S / self.round_s

    def lines(self) -> list[str]:
        """The requirements as the doctor prints them, one line a resource."""
        pace = (
            f"at one round every {self.round_s:,.0f} s"
            if self.round_s is not None
            else "per day: give --round-s (the spec sets no time budget)"
        )
        up, down = self.per_day(self.up_per_round), self.per_day(self.down_per_round + self.data_per_round)
        data = f" + {_size(self.data_per_round)} of data" if self.data_per_round else ""
        return [
            f"model         {self.params:,} parameters",
            f"GPU memory    {gib(self.gpu_bytes)} per GPU (the spec's micro-batches and checkpointing)",
            f"host RAM      {gib(self.host_bytes)} with a GPU, {gib(self.cpu_host_bytes)} training on the CPU",
            f"/dev/shm      {gib(self.shm_bytes)} (docker: --shm-size)",
            f"disk          {_size(self.disk_bytes)} (checkpoints, kept updates, the state served to newcomers"
            + (", a day of data)" if data and self.round_s else ")"),
            f"upload        {_size(self.up_per_round)} per round"
            + (f", {up / GB:,.1f} GB per day {pace}" if up is not None else f"; {pace}"),
            f"download      {_size(self.down_per_round)} per round{data}"
            + (f", {down / GB:,.1f} GB per day {pace}" if down is not None else "")
            + f"; joining: {_size(self.join_bytes)} once",
        ]

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "params": self.params,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "cpu_host_bytes": self.cpu_host_bytes,
            "shm_bytes": self.shm_bytes,
            "disk_bytes": self.disk_bytes,
            "up_bytes_per_round": self.up_per_round,
            "down_bytes_per_round": self.down_per_round,
            "data_bytes_per_round": self.data_per_round,
            "join_bytes": self.join_bytes,
            "round_s": self.round_s,
            "up_bytes_per_day": self.per_day(self.up_per_round),
            "down_bytes_per_day": self.per_day(self.down_per_round + self.data_per_round),
        }


def requirements(spec: RunSpec, *, round_s: float | None = None) -> Requirements:
    """One peer's needs for ``spec``; ``round_s``: seconds per round for the per-day figures
    (default: the spec's time budget). Raises ``ValueError`` for a task of no stated size."""
    params = task_params(spec)
    if params is None:
        raise ValueError("the spec's task declares no parameter count (task.params): nothing to size")
    if round_s is not None and round_s <= 0:
        raise ValueError(f"a round lasts a positive number of seconds, not {round_s}")
    gpu = estimate(spec, accelerator=True)
    cpu = estimate(spec, accelerator=False)
    update = params * spec.averaging.wire_bytes_per_value()
    data = _data_per_round(spec)
    pace = round_s if round_s is not None else spec.rounds.time_budget_s
    data_day = data * DAY_S / pace if pace else 0.0
    served = 2 * FP32 * params  # the state a newcomer downloads, as a file (engine.state_snapshot)
    disk = (
        _checkpoint_bytes(spec, params) * CHECKPOINTS_KEPT + min(KEPT_ROUNDS * update, KEPT_BYTES) + served + data_day
    )
    return Requirements(
        params=params,
        gpu_bytes=gpu.total("device"),
        host_bytes=gpu.total("host"),
        cpu_host_bytes=cpu.total("host"),
        shm_bytes=gpu.total("shm"),
        disk_bytes=int(disk),
        up_per_round=2 * update,
        down_per_round=2 * update,
        data_per_round=data,
        join_bytes=2 * FP32 * params,
        round_s=pace,
    )


def _checkpoint_bytes(spec: RunSpec, params: int) -> float:
    """θ_g, the momentum and the model (fp32), the inner optimizer (AdamW: two moments) and the
    codec residual."""
    per_value = 3 * FP32 + (2 * FP32 if spec.inner.optimizer == "adamw" else 0)
    if spec.averaging.error_feedback and spec.averaging.compression in LOSSY_CODECS:
        per_value += RESIDUAL_BYTES
    return float(per_value * params)


def _data_per_round(spec: RunSpec) -> float:
    """The shard bytes one data stream reads in a round of H inner steps (0 when the data is
    on every machine, or a round has no step count)."""
    lm = spec.task.causal_lm
    if spec.data.source != "tokens" or lm is None or spec.rounds.inner_steps is None:
        return 0.0
    vocab = int(lm.config.get("vocab_size", VOCAB_SIZE))
    per_token = ITEMSIZE[dtype_for_vocab(vocab)]
    return float(spec.rounds.inner_steps * spec.inner.batch_size * (lm.seq_len + 1) * per_token)


def _size(n: float) -> str:
    if n >= GB:
        return f"{n / GB:,.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} MB"
    return f"{n / 1e3:,.1f} kB"
