"""One training run of the quality benchmark (``benchmarks.training_quality``): a spec with
overrides, run in process (``benchmarks.loopback_group``) or as a real local swarm of
``swarmtrain peer`` processes, giving the validation loss of the swarm's model per round."""

from __future__ import annotations

import copy
import faulthandler
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loopback_group import LoopbackGroup, LoopbackSwarm
from benchmarks.overlap_reference import overlap_reference
from peer.round.trainer import Trainer, TrainerOptions
from peer.task import build_task
from protocol.identity import Identity
from protocol.modelsize import count_params
from protocol.spec import RunSpec, parse_spec

Overrides = dict[str, dict[str, Any]]
"""``{section: {key: value}}`` over the base spec (dotted sections: ``"task.model"``)."""


@dataclass(frozen=True)
class Setup:
    """What one run trains: the base spec's text, overrides, the members and the seed."""

    name: str
    members: int
    overrides: Overrides = field(default_factory=dict)
    delay_steps: int | None = None
    """In process, with overlap: inner steps before a launched round lands (None: H, a whole
    inner phase, the longest delay overlap allows)."""
    drop: float = 0.0
    """In process: the probability that a member's update is left out of a round
    (``LoopbackGroup.drop``)."""
    reference_codec: str | None = None
    """In process: a codec the product does not ship, for the members' error feedback and the
    group's reduction in place of the spec's (``topk``: ``benchmarks.topk_reference``, with its
    decayed error feedback)."""
    reference_start: str | None = None
    """In process, with ``overlap_start = "eager"``: a start point the product does not ship for
    the inner steps taken while a round averages (``benchmarks.overlap_reference.STARTS``)."""
    reference_mix: float | None = None
    """In process, with overlap: Streaming DiLoCo's landing with this α
    (``benchmarks.overlap_reference.mixed_landing``)."""


def spec_text(base: str, overrides: Overrides) -> dict[str, Any]:
    """The base TOML with ``overrides`` applied, as a dict (a key set to None is removed)."""
    data = tomllib.loads(base)
    for section, values in overrides.items():
        node = data
        for part in section.split("."):
            node = node.setdefault(part, {})
        for key, value in values.items():
            if value is None:
                node.pop(key, None)
            else:
                node[key] = value
    return data


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A spec dict as TOML (tables of scalars and lists: what a spec holds)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    for key, value in scalars.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables.items():
        lines.append(to_toml(value, f"{prefix}.{key}" if prefix else key))
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def build_spec(base: str, setup: Setup, *, seed: int, rounds: int) -> RunSpec:
    """The run's spec: base + overrides, data seed ``seed``, ``rounds`` rounds, validation every
    round (unless the overrides say otherwise), no time budget (a round is its H steps whatever the machine's speed)."""
    return parse_spec(run_toml(base, setup, seed=seed, rounds=rounds), source=setup.name)


def run_toml(base: str, setup: Setup, *, seed: int, rounds: int) -> str:
    """The TOML text of ``build_spec``'s spec (what a real swarm's peers are given)."""
    overrides = copy.deepcopy(setup.overrides)
    overrides.setdefault("data", {})["seed"] = seed
    overrides.setdefault("rounds", {}).update({"max_rounds": rounds, "time_budget_s": None})
    overrides.setdefault("eval", {}).setdefault("every_rounds", 1)
    return to_toml(spec_text(base, overrides))


@dataclass
class RunResult:
    name: str
    seed: int
    members: int
    kind: str
    """``inprocess`` or ``swarm``."""
    val_loss: list[float]
    """Validation loss of θ_g after each round (index: rounds landed)."""
    wall_s: float
    robust: dict[str, int] = field(default_factory=dict)
    averaged_fraction: float = 1.0
    """Peer-rounds that averaged (the real swarm; 1 in process)."""
    bytes_per_member_round: float | None = None
    """Averaging bytes each member sent and received per round: measured in a real swarm (the
    peers' round rows), the codec's wire bytes for the butterfly in process."""

    @property
    def final(self) -> float:
        return self.val_loss[-1] if self.val_loss else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "members": self.members,
            "kind": self.kind,
            "val_loss": self.val_loss,
            "final": self.final,
            "wall_s": round(self.wall_s, 2),
            "robust": self.robust,
            "averaged_fraction": self.averaged_fraction,
            "bytes_per_member_round": self.bytes_per_member_round,
        }


def run_inprocess(base: str, setup: Setup, *, seed: int, rounds: int, deadline_s: float = 900.0) -> RunResult:
    """``setup`` as ``setup.members`` trainers in this process (``benchmarks.loopback_group``)."""
    spec = build_spec(base, setup, seed=seed, rounds=rounds)
    eager = spec.averaging.overlap and spec.averaging.overlap_start == "eager"
    if setup.reference_start is not None and not eager:  # else the product never calls it: a silent no-op
        raise ValueError(f"{setup.name}: a reference start needs overlap with overlap_start = 'eager'")
    quiet = spec.model_copy(update={"eval": spec.eval.model_copy(update={"every_rounds": 0})})
    numel = count_params(spec.task.model) if spec.task.kind == "bytegpt" else None
    h = spec.rounds.inner_steps or 1
    group = LoopbackGroup(
        setup.members,
        spec.averaging,
        delay_steps=h if setup.delay_steps is None else setup.delay_steps,
        seed=seed,
        drop=setup.drop,
    )
    if setup.reference_codec == "topk":
        from benchmarks.topk_reference import TopKCodec

        group.codec = TopKCodec()
    elif setup.reference_codec is not None:
        raise ValueError(f"unknown reference codec {setup.reference_codec!r}")
    trainers: list[Trainer] = []
    for index in range(setup.members):
        member_spec = spec if index == 0 else quiet  # θ_g is the same in every member: one evaluates
        task = build_task(member_spec, shard_seed=index)
        size = numel if numel is not None else sum(p.numel() for p in task.model.parameters())
        swarm = LoopbackSwarm(group, index, size)
        # the landing on the training thread: the step it lands at depends on the group alone
        options = TrainerOptions(
            identity=Identity.generate(), max_rounds=rounds, wait_for_group_s=0.0, host_thread=False
        )
        trainer = Trainer(member_spec, task, swarm, options)  # type: ignore[arg-type]
        swarm.steps = lambda t=trainer: t.inner_steps_done
        if setup.reference_codec is not None:
            from benchmarks.topk_reference import DecayedFeedback

            trainer.codec = group.codec
            trainer.feedback = DecayedFeedback(group.codec, size)
        trainers.append(trainer)
    errors: list[BaseException] = []

    def work(trainer: Trainer) -> None:
        try:
            trainer.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            group.close()

    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in trainers]
    with overlap_reference(setup.reference_start, setup.reference_mix):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(1.0, deadline_s - (time.monotonic() - started)))
            if thread.is_alive():  # a member stuck: show where, then give up on the run
                faulthandler.dump_traceback(all_threads=True)
                group.close()
                raise RuntimeError(f"{setup.name} (seed {seed}): a member did not finish in {deadline_s:.0f} s")
    if errors:
        raise RuntimeError(f"{setup.name} (seed {seed}) failed in process") from errors[0]
    losses = [m.val_loss for m in trainers[0].history if m.val_loss is not None]
    n = setup.members
    size = numel if numel is not None else sum(p.numel() for p in trainers[0].task.model.parameters())
    wire = 2 * 2 * (n - 1) / n * size * spec.averaging.wire_bytes_per_value() if n > 1 else 0.0
    if getattr(group.codec, "gathered", False):  # an all-gather: n - 1 payloads out and n - 1 in
        wire = 2 * (n - 1) * size * group.codec.bytes_per_value()
    return RunResult(
        setup.name,
        seed,
        n,
        "inprocess",
        losses,
        time.monotonic() - started,
        group.tally.as_dict(),
        bytes_per_member_round=wire,
    )


def run_swarm(base: str, setup: Setup, *, seed: int, rounds: int, timeout_s: float = 1800.0) -> RunResult:
    """``setup`` as a real local swarm: ``setup.members`` ``swarmtrain peer`` processes on
    loopback (hivemind DHT, matchmaking, the exact all-reduce), the first bootstrapping the
    rest. The loss per round is the first reported value of each round's θ_g (every in-sync
    member evaluates the same state)."""
    from swarmtrain.localswarm import start_peers, wait_all  # the launcher: only for real swarms

    if setup.reference_start is not None or setup.reference_mix is not None or setup.reference_codec is not None:
        raise ValueError(f"{setup.name}: a reference the product does not ship runs in process only")
    spec = build_spec(base, setup, seed=seed, rounds=rounds)
    with tempfile.TemporaryDirectory(prefix="swarmtrain-quality-") as tmp:
        workdir = Path(tmp)
        path = workdir / "spec.toml"
        path.write_text(run_toml(base, setup, seed=seed, rounds=rounds))
        started = time.monotonic()
        peers = start_peers(path, setup.members, workdir, extra=["--device", "cpu"])
        try:
            for peer, code in zip(peers, wait_all(peers, timeout_s)):
                if code != 0:
                    raise RuntimeError(f"{setup.name}: {peer.name} failed:\n" + "\n".join(peer.lines[-30:]))
        finally:
            for peer in peers:
                peer.kill()
        wall = time.monotonic() - started
        rows = [peer.rounds() for peer in peers]
    by_round: dict[int, float] = {}
    for history in rows:
        for row in history:
            if row.get("val_loss") is not None and row.get("in_sync"):
                by_round.setdefault(int(row["round"]), float(row["val_loss"]))
    losses = [by_round[r] for r in sorted(by_round)]
    averaged = [bool(row.get("averaged")) for history in rows for row in history]
    if spec.rounds.max_rounds not in by_round:
        raise RuntimeError(f"{setup.name} (seed {seed}): no member reported round {spec.rounds.max_rounds}")
    fraction = sum(averaged) / max(1, len(averaged))
    moved = [
        float(row.get("bytes_sent", 0)) + float(row.get("bytes_received", 0))
        for history in rows
        for row in history
        if row.get("averaged")
    ]
    per_member = sum(moved) / len(moved) if moved else None
    return RunResult(setup.name, seed, setup.members, "swarm", losses, wall, {}, fraction, per_member)
