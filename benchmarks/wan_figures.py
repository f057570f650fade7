"""The figures of the WAN benchmark, from the peers' metrics rows (pure; unit-tested).

Per configuration: compute utilization (compute time / wall time, per peer, then the mean),
swarm samples/s, bytes sent per peer per round and per sample, the all-reduce time against
the link bound 2·(n−1)/n·S/B (S: the vector's size on the wire under the codec, B: the
link rate), and the loss after the last round (every configuration processes the same
samples per round, so equal rounds are equal samples).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from protocol.spec import AveragingSection

WIRE_BYTES_PER_VALUE = {
    name: AveragingSection.model_validate({"compression": name}).wire_bytes_per_value()
    for name in ("none", "fp16", "int8", "4bit", "sparse")
}
"""Bytes per value each codec puts on the wire, scales included, at the spec's defaults
(``protocol.spec.AveragingSection.wire_bytes_per_value``: one definition for the spec, the
doctor and the benchmarks)."""


def link_bound_s(*, peers: int, params: int, codec: str, link_bps: float) -> float:
    """Seconds a bandwidth-optimal all-reduce of the vector needs over links of ``link_bps``."""
    if peers < 2:
        return 0.0
    size_bytes = params * WIRE_BYTES_PER_VALUE[codec]
    return 2 * (peers - 1) / peers * size_bytes * 8 / link_bps


@dataclass(frozen=True)
class Figures:
    name: str
    rounds: int
    utilization: float
    """Mean over peers of compute time / the training thread's time (``busy_s``)."""
    utilization_per_peer: tuple[float, ...]
    samples_per_s: float
    bytes_per_peer_round: float
    bytes_per_sample: float
    allreduce_s: float
    link_bound_s: float
    link_efficiency: float
    final_loss: float
    wall_s: float
    steady_utilization: float = float("nan")
    """Utilization without each peer's last round as well: nothing follows it to overlap its
    averaging with, so it always waits; a run of thousands of rounds has one such round."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def busy_s(row: dict[str, Any]) -> float:
    """The training thread's time for one round: inner steps + waiting for the group + host
    work, where the row says (swarmtrain rows with ``host_s``). A round's ``wall_s`` runs from
    its first inner step to its result, which with overlap spans the next round's inner
    steps too, so summing it would count overlapped time twice; rows without ``host_s``
    (hivemind baselines, older swarmtrain) fall back to ``wall_s``."""
    if "host_s" in row and "wait_s" in row:
        return float(row["compute_s"] + row["wait_s"] + row["host_s"])
    return float(row["wall_s"])


def figures(
    name: str,
    histories: list[list[dict[str, Any]]],
    *,
    codec: str,
    link_bps: float,
    skip_first: int = 1,
    link_bytes: list[int] | None = None,
) -> Figures:
    """Figures of one run from each peer's rows (the first ``skip_first`` rounds are start-up).
    ``link_bytes``: bytes each peer put on its link over the whole run (measured on the
    simulated link); when given, the byte figures come from it instead of the rows."""
    rows_by_peer = [h[skip_first:] or h for h in histories]
    if not any(rows_by_peer):
        raise ValueError(f"{name}: no rounds recorded")
    peers = len(histories)
    per_peer = tuple(
        sum(r["compute_s"] for r in rows) / max(sum(busy_s(r) for r in rows), 1e-9) for rows in rows_by_peer if rows
    )
    utilization = statistics.mean(per_peer)
    steady = [
        sum(r["compute_s"] for r in rows[:-1]) / max(sum(busy_s(r) for r in rows[:-1]), 1e-9)
        for rows in rows_by_peer
        if len(rows) > 1
    ]
    wall = max(sum(busy_s(r) for r in rows) for rows in rows_by_peer)
    samples = sum(r["samples"] for rows in rows_by_peer for r in rows)
    averaged = [r for rows in rows_by_peer for r in rows if r.get("averaged")]
    sent = statistics.mean(r["bytes_sent"] for r in averaged) if averaged else 0.0
    per_sample = sum(r["bytes_sent"] for r in averaged) / max(sum(r["samples"] for r in averaged), 1)
    if link_bytes is not None:
        rounds_run = [len(h) for h in histories]
        sent = statistics.mean(b / max(n, 1) for b, n in zip(link_bytes, rounds_run))
        per_sample = sum(link_bytes) / max(sum(r["samples"] for h in histories for r in h), 1)
    timed = [r["allreduce_s"] for r in averaged if r.get("allreduce_s")]
    allreduce = statistics.median(timed) if timed else float("nan")
    params = histories[0][0]["params"]
    bound = link_bound_s(peers=peers, params=params, codec=codec, link_bps=link_bps)
    # a peer's last row that measured a loss (a round joined with no steps has NaN)
    finals = [next((r["loss"] for r in reversed(h) if math.isfinite(r["loss"])), math.nan) for h in histories]
    final_loss = statistics.mean(finals) if finals else math.nan
    return Figures(
        name=name,
        rounds=min(len(h) for h in histories),
        utilization=utilization,
        utilization_per_peer=per_peer,
        samples_per_s=samples / max(wall, 1e-9),
        bytes_per_peer_round=sent,
        bytes_per_sample=per_sample,
        allreduce_s=allreduce,
        link_bound_s=bound,
        link_efficiency=bound / allreduce if timed else float("nan"),
        final_loss=final_loss,
        wall_s=wall,
        steady_utilization=statistics.mean(steady) if steady else float("nan"),
    )


def markdown_table(results: list[Figures], *, reference: str | None = None) -> str:
    """One row per configuration; loss relative to ``reference`` (e.g. fp32 averaging)."""
    ref = next((r for r in results if r.name == reference), None)

    def num(value: float, fmt: str) -> str:
        return "-" if value != value else format(value, fmt)  # NaN: not measured

    lines = [
        "| configuration | utilization (min peer) | without the last round | swarm samples/s "
        "| MB sent / peer / round | bytes / sample | all-reduce s | link bound s | % of link bound | final loss "
        "| vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        versus = f"{100 * (r.final_loss / ref.final_loss - 1):+.2f}%" if ref else "-"
        lines.append(
            f"| {r.name} | {100 * r.utilization:.1f}% ({100 * min(r.utilization_per_peer):.1f}%) "
            f"| {num(100 * r.steady_utilization, '.1f')}% | {r.samples_per_s:.1f} | {r.bytes_per_peer_round / 1e6:.2f} "
            f"| {r.bytes_per_sample:.0f} | {num(r.allreduce_s, '.2f')} | {r.link_bound_s:.2f} "
            f"| {num(100 * r.link_efficiency, '.0f')}% | {r.final_loss:.4f} | {versus} |"
        )
    return "\n".join(lines)
