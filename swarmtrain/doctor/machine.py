"""Checks of this host: libraries, accelerator, identity, open files, /dev/shm, memory for the
run's model, a loopback DHT, and how fast it runs the run's inner steps."""

from __future__ import annotations

import importlib.metadata
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.node.footprint import Footprint, estimate, gib
from protocol.identity import Identity
from protocol.spec import RunSpec, local_compute
from swarmtrain.doctor.verdict import CheckFailed, CheckWarning

PACKAGES = ("torch", "hivemind", "grpcio", "protobuf", "pydantic", "cryptography", "transformers")
MIN_OPEN_FILES = 4096
"""p2pd and hivemind keep a socket per connection and a few files per stream: a peer in a
large swarm opens thousands (a soft limit of 1024, common on Linux, runs out)."""
SHM_PATH = Path("/dev/shm")
SHM_SLACK = 1.1
"""Room beyond the averager's vector (hivemind's own shared buffers, a second stream)."""


def python() -> str:
    if sys.version_info < (3, 11):  # noqa: UP036 - an installed copy run by an older interpreter says so
        raise CheckFailed(f"Python >= 3.11 needed, this is {sys.version.split()[0]}", "install Python 3.11 or newer")
    return sys.version.split()[0]


def packages() -> tuple[str, dict[str, Any]]:
    versions: dict[str, str] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    missing = [n for n, v in versions.items() if v == "missing"]
    if missing:
        raise CheckFailed(
            f"not installed: {', '.join(missing)}", "pip install swarmtrain (in a fresh virtualenv)", versions=versions
        )
    return ", ".join(f"{n} {v}" for n, v in versions.items()), {"versions": versions}


def stubs() -> str:
    from protocol import coordinator_pb2, coordinator_pb2_grpc  # noqa: F401

    return "coordinator API importable"


@dataclass(frozen=True)
class Accelerator:
    count: int
    names: list[str]
    memory: list[int]
    """Free bytes on each device now."""
    bf16: bool
    nccl: str | None


def accelerator() -> Accelerator:
    import torch

    if not torch.cuda.is_available():
        return Accelerator(0, [], [], False, None)
    count = torch.cuda.device_count()
    nccl = None
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    free = [torch.cuda.mem_get_info(i)[0] for i in range(count)]
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    return Accelerator(count, names, free, torch.cuda.is_bf16_supported(), nccl)


def describe_accelerator(acc: Accelerator) -> tuple[str, dict[str, Any]]:
    import torch

    data = {"gpus": acc.count, "names": acc.names, "free_bytes": acc.memory, "bf16": acc.bf16, "nccl": acc.nccl}
    if not acc.count:
        return f"no CUDA device: CPU only (fp32; torch {torch.__version__})", data
    precision = "bf16 autocast" if acc.bf16 else "fp16 autocast with a gradient scaler (no bf16)"
    names = ", ".join(sorted(set(acc.names)))
    detail = f"{acc.count} x {names}; CUDA {torch.version.cuda}; {precision}"
    if acc.count > 1 and acc.nccl is None:
        raise CheckWarning(
            detail + "; NCCL unavailable", "install a CUDA build of torch with NCCL (ranks fall back to gloo)", **data
        )
    return detail + (f"; NCCL {acc.nccl}" if acc.nccl else ""), data


def identity(path: Path) -> str:
    if not path.exists():
        return f"no key at {path} yet: a peer creates one there on first start (or run `swarmtrain keygen`)"
    try:
        return f"{Identity.load(path).public_key.id} ({path})"
    except Exception as exc:
        raise CheckFailed(
            f"{path}: {exc}", "restore the key from a backup, or move it away to start a new account"
        ) from exc


def open_files() -> tuple[str, dict[str, Any]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    data = {"soft": soft, "hard": hard}
    detail = f"soft limit {soft}, hard {hard if hard != resource.RLIM_INFINITY else 'unlimited'}"
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        fix = f"`ulimit -n {MIN_OPEN_FILES * 16}` before starting the peer (docker: --ulimit nofile=65536:65536)"
        if soft < 1024:
            raise CheckFailed(detail + f": too low for p2pd (needs >= {MIN_OPEN_FILES})", fix, **data)
        raise CheckWarning(detail + f": a large swarm needs >= {MIN_OPEN_FILES}", fix, **data)
    return detail, data


def shm_free(path: Path = SHM_PATH) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def shm(footprint: Footprint | None, path: Path = SHM_PATH) -> tuple[str, dict[str, Any]]:
    try:
        free = shm_free(path)
    except OSError as exc:
        raise CheckFailed(f"{path}: {exc.strerror}", "the averager needs a shared-memory mount at /dev/shm") from exc
    data: dict[str, Any] = {"free_bytes": free}
    if footprint is None:
        return f"{gib(free)} free (no run spec: the need is not known)", data
    need = int(footprint.total("shm") * SHM_SLACK)
    data["need_bytes"] = need
    if free < need:
        raise CheckFailed(
            f"{path} has {gib(free)} free, the averager needs {gib(need)} for this model's "
            f"{footprint.params:,} parameters",
            f"give the container more shared memory: docker run --shm-size={max(1, -(-need // (1 << 30)))}g "
            "(compose: shm_size), or remount: mount -o remount,size=... /dev/shm",
            **data,
        )
    return f"{gib(free)} free, the averager needs {gib(need)}", data


def host_available() -> int:
    """Bytes of host memory available to a new process (MemAvailable), or the physical total."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Fit:
    footprint: Footprint
    sharded: bool


PLAN_HEADROOM = 0.9
"""A plan the doctor suggests must need at most this share of a GPU's free memory (the
allocator's cache and fragmentation come on top of the estimate)."""


@dataclass(frozen=True)
class Plan:
    """How one peer computes a causal-LM run's inner steps on its GPU (``--micro-batches``,
    ``--activation-checkpointing``, ``--compile``) and the GPU memory that needs (estimated,
    for eager blocks: compiled ones need less)."""

    micro_batches: int
    checkpointing: bool
    device_bytes: int
    compile: bool = True

    @property
    def flags(self) -> str:
        on = {True: "on", False: "off"}
        return (
            f"--micro-batches {self.micro_batches} --activation-checkpointing {on[self.checkpointing]} "
            f"--compile {on[self.compile]}"
        )


def plans(spec: RunSpec) -> list[Plan]:
    """Every way a peer may compute ``spec``'s steps on a GPU, the likely fastest first: compiled
    blocks (an H200 measured 35-40% more tokens/s at every setting,
    ``benchmarks/results/lm-throughput-2026-11-25-h200-*``), without activation checkpointing
    before with it (it recomputes the forward: 25-30% slower), then fewer micro-batches before
    more (larger matmuls). Empty for runs of other tasks."""
    if spec.task.causal_lm is None:
        return []
    batch = spec.inner.batch_size
    out = []
    for checkpointing in (False, True):
        for micro in (m for m in range(1, batch + 1) if batch % m == 0):
            local = local_compute(spec, micro_batches=micro, checkpointing=checkpointing)
            out.append(Plan(micro, checkpointing, estimate(local, accelerator=True).total("device")))
    return out


def fastest_plan(spec: RunSpec, free_bytes: int) -> Plan | None:
    """The likely fastest plan that fits ``free_bytes`` of one GPU with headroom, if any."""
    return next((p for p in plans(spec) if p.device_bytes <= PLAN_HEADROOM * free_bytes), None)


def _plan_hint(spec: RunSpec, per_gpu: int) -> str:
    """ "; likely faster on this GPU: FLAGS (~N GiB)" when a plan that fits is surely no slower
    than the run's own: compiled, no more micro-batches and no checkpointing where the run has
    none (which of fewer micro-batches with checkpointing and more without is faster depends on
    the GPU: not suggested)."""
    lm = spec.task.causal_lm
    if lm is None:
        return ""
    better = [
        p
        for p in plans(spec)
        if p.device_bytes <= PLAN_HEADROOM * per_gpu
        and p.micro_batches <= lm.micro_batches
        and (not p.checkpointing or lm.activation_checkpointing)
        and (p.micro_batches, p.checkpointing, p.compile) != (lm.micro_batches, lm.activation_checkpointing, lm.compile)
    ]
    if not better:
        return ""
    return f"; likely faster on this GPU: `swarmtrain peer ... {better[0].flags}` (~{gib(better[0].device_bytes)})"


def memory(spec: RunSpec, acc: Accelerator, *, host_bytes: int | None = None) -> tuple[Fit, str, dict[str, Any]]:
    """Whether the run's model fits this GPU(s) and host memory; raises ``CheckFailed`` when not."""
    host = host_available() if host_bytes is None else host_bytes
    footprint = estimate(spec, accelerator=acc.count > 0, local_ranks=max(1, acc.count))
    sharded = False
    if acc.count:
        per_gpu = min(acc.memory)
        if footprint.total("device") > per_gpu and acc.count > 1:
            footprint, sharded = estimate(spec, accelerator=True, local_ranks=acc.count, sharded=True), True
        need_gpu = footprint.total("device")
        smaller = fastest_plan(spec, per_gpu) if need_gpu > per_gpu else None
        if smaller is not None:
            raise CheckFailed(
                f"not enough GPU memory for this run's micro-batches and checkpointing ({footprint.params:,} "
                f"parameters): needs ~{gib(need_gpu)} per GPU ({footprint.describe('device')}), {gib(per_gpu)} free",
                f"run the peer with `{smaller.flags}` (~{gib(smaller.device_bytes)}: the same steps in less memory)",
                need_bytes=need_gpu,
                free_bytes=per_gpu,
            )
        if need_gpu > per_gpu:
            raise CheckFailed(
                f"not enough GPU memory for this model ({footprint.params:,} parameters): needs ~{gib(need_gpu)} "
                f"per GPU ({footprint.describe('device')}), {gib(per_gpu)} free",
                "use a GPU with more memory or more GPUs (sharded with FSDP2), or a run with a smaller model; "
                "activation_checkpointing and micro_batches in the spec shrink activations only",
                need_bytes=need_gpu,
                free_bytes=per_gpu,
            )
    need_host = footprint.total("host")
    data = {"params": footprint.params, "host_need_bytes": need_host, "host_available_bytes": host}
    if need_host > host:
        raise CheckFailed(
            f"not enough memory for this model ({footprint.params:,} parameters): needs ~{gib(need_host)} of host "
            f"memory ({footprint.describe('host')}), {gib(host)} available",
            "a machine with more RAM (or close other programs), or a run with a smaller model",
            **data,
        )
    where = (
        f"~{gib(footprint.total('device'))} per GPU{' sharded over ' + str(acc.count) + ' GPUs' if sharded else ''}, "
        if acc.count
        else ""
    )
    detail = f"{footprint.params:,} parameters fit: {where}~{gib(need_host)} of {gib(host)} host memory (estimated)"
    if acc.count and not sharded:
        detail += _plan_hint(spec, min(acc.memory))
    return Fit(footprint, sharded), detail, data


def loopback_dht() -> str:
    from hivemind import DHT
    from hivemind.utils.timed_storage import get_dht_time

    started = time.monotonic()
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        second = DHT(start=True, initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            first.store("swarmtrain-doctor", "ok", get_dht_time() + 30)
            found = second.get("swarmtrain-doctor", latest=True)
            if found is None or found.value != "ok":
                raise CheckFailed(
                    "two local DHT nodes could not exchange a record", "reinstall hivemind (its p2pd binary)"
                )
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    return f"two nodes exchanged a record in {time.monotonic() - started:.1f} s"
