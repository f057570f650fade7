"""Does the swarm train as well as the DiLoCo papers say? (issue #34): ``make bench-quality``.

The swarm of k peers against two references at equal tokens and inner steps: synchronous data
parallel (one trainer with k times the batch: AdamW on the mean gradient of k x batch samples
is what k workers averaging gradients every step compute) and one peer alone (the batch of
one swarm member, a k-th of the tokens). Each reference is a group of one with outer lr 1 and
no momentum, no codec, no robust rule: its θ_g is its own model after every H steps.

Suites (``--suite``): ``headline`` (the shipped defaults, and overlap on, robust averaging off
or at the old clip, the old defaults), ``outer`` (Nesterov 0.7/0.9, plain averaging, outer
SGD), ``outer-lr`` (Nesterov's lr at H = 5 and 20, fixed tokens), ``lr`` (the inner lr, the
references at the same lr), ``horizon`` (the defaults over 4x the rounds, the gaps read off the
curves), ``diagnose`` (plain averaging without codec at H = 20 and H = 1: how much of the gap
to sync DP is each member's own AdamW step rather than how rarely the members meet),
``batch`` (each member's batch 2 / 8 / 32, the references' with it), ``hk`` (H and k at fixed tokens), ``codec``, ``overlap`` (off, on with the next inner phase
starting at this peer's own end point or eagerly, landing after a whole phase or a quarter of
one), ``overlap-h`` (overlap's cost as H grows at fixed tokens: off, landing 2 steps late (with and
without an eager start), landing H/4 steps late, at H = 10, 20 and 40), ``overlap-start`` (where
the steps taken while a round averages start, at H = 20, landing 1 or 2 steps late: this peer's
own end point, θ̂, and references the product does not ship, ``benchmarks.overlap_reference``), ``overlap-defaults`` (the demo's settings, robust averaging and int8 included, at H = 30 as in
the realistic WAN regime, without overlap and landing 1, 2 or 3 steps late), ``robust`` (on and off in groups of 2, 4 and 8), ``scale`` (the model's width: 32, 64, 128),
``partial`` (groups that form with fewer members: each member's update left out of a share of
the rounds, as a late joiner's first group or a peer split off a round leaves it out).

Every run is in process (``benchmarks.loopback_group``: real trainers, the all-reduce's
arithmetic, no network), a pure function of spec and seed; ``--swarm`` also runs the headline
defaults and the old defaults as real local swarms (``swarmtrain peer`` processes, hivemind DHT and all-reduce on
loopback), to check that the in-process numbers are the swarm's. The model and data are the
demo's (``examples/demo.toml``: byte-level GPT, 135K parameters, the Python standard library).

Writes ``benchmarks/results/training-quality.{md,json,png}``. Usage:
``python -m benchmarks.training_quality [--suite headline,outer,...] [--seeds 0,1,2] [--rounds 30] [--swarm]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.quality_runs import Overrides, RunResult, Setup, run_inprocess, run_swarm

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BASE = REPO / "examples" / "demo.toml"
BATCH = 8
"""Each swarm member's batch (the demo's)."""
H = 20
"""The demo's inner steps."""

REFERENCE: Overrides = {
    "outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
    "averaging": {
        "compression": "none",
        "robust": False,
        "overlap": False,
        "error_feedback": False,
        "min_group_size": 1,
    },
}


def merge(*layers: Overrides) -> Overrides:
    out: Overrides = {}
    for layer in layers:
        for section, values in layer.items():
            out.setdefault(section, {}).update(values)
    return out


def sync_dp(k: int, h: int = H, shared: Overrides | None = None, per_member: int = BATCH) -> Setup:
    batch = {"inner": {"batch_size": k * per_member}, "rounds": {"inner_steps": h}}
    return Setup(f"sync DP (batch {k * per_member})", 1, merge(shared or {}, REFERENCE, batch))


def one_peer(h: int = H, shared: Overrides | None = None, per_member: int = BATCH) -> Setup:
    steps = {"inner": {"batch_size": per_member}, "rounds": {"inner_steps": h}}
    return Setup(f"one peer (batch {per_member})", 1, merge(shared or {}, REFERENCE, steps))


OVERLAP_OFF: Overrides = {"averaging": {"overlap": False}}
OVERLAP_ON: Overrides = {"averaging": {"overlap": True, "sync_fragments": 1}}
"""Overlap with the whole vector averaged at once (its fragments in turn are the default with overlap)."""
EAGER: Overrides = {"averaging": {"overlap": True, "overlap_start": "eager"}}
IN_TURN: Overrides = {"averaging": {"overlap": True, "sync_fragments": 2}}
"""Overlap with the pseudo-gradient's 2 fragments averaged in turn (``peer.round.in_turn``; the
demo's model of 137K values has room for 2 fragments of at least 64K)."""
ROBUST_OFF: Overrides = {"averaging": {"robust": False}}
SPARSE: Overrides = {"averaging": {"compression": "sparse"}}
"""The sparse codec at its defaults (1/4 of the values a round, 2-bit)."""
OUTER_LR_1: Overrides = {"outer": {"lr": 1.0}}
TOPK = "top-k 64 of 4096, all-gather (SparseLoCo: decayed EF, outer SGD lr 1)"
"""Each member's own top-k in 2 bits with error feedback decayed by 0.95, gathered, outer SGD
without momentum (``benchmarks.topk_reference``): SparseLoCo's recipe, a reference the
butterfly cannot carry, its bytes those of an all-gather over a mesh."""
SPARSELOCO_OUTER: Overrides = {"outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False}}
CLIP_1: Overrides = {"averaging": {"clip": 1.0}}
PLAIN_OUTER: Overrides = {"outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False}}
EVAL_20: Overrides = {"eval": {"every_rounds": 20}}
"""Validation every 20 rounds (rows of 1-step rounds: the loss at the same inner steps as H = 20)."""
BARE: Overrides = merge(REFERENCE, {"averaging": {"min_group_size": 2}})
"""The swarm with nothing but the mean of its members' models after each phase (the
references' settings): at H = 1, each step's update is the mean of k AdamW steps, each on its
member's batch and moments, where sync DP takes one AdamW step on the mean gradient."""


HORIZON_SCALE = 4.0
"""The ``horizon`` suite's row runs this many times ``--rounds``; its table reads the gap off
the curves at fractions of that (the demo's learning rate is constant, so a curve's point at
round r is what a run of r rounds ends at)."""


@dataclass(frozen=True)
class Row:
    """One line of a suite: a swarm setup, the rounds it runs, and its references."""

    setup: Setup
    rounds_scale: float = 1.0
    """This row's rounds as a fraction of ``--rounds`` (H and k at fixed tokens)."""
    k: int = 4
    h: int = H
    real: bool = False
    """With ``--swarm``, also run as real local swarms (the rows the in-process swarm is checked on)."""
    batch: int = BATCH
    """Each member's batch (the references' follow: sync DP k x it, one peer it)."""
    shared: Overrides = field(default_factory=dict)
    """Overrides of the row that its references share (the model, for the scale suite)."""


def suites() -> dict[str, list[Row]]:
    """The comparisons, each row against its references. A row's base is the demo's spec with
    overlap off (the shipped default; each overlap row says its own): robust averaging on with clip 2, Nesterov 0.7 / 0.9, int8 with error feedback."""
    swarm = lambda name, *o, k=4, **kw: Setup(name, k, merge(OVERLAP_OFF, *o), **kw)  # noqa: E731
    return {
        "headline": [
            Row(swarm("swarm of 4, defaults"), real=True),
            Row(swarm("overlap on (lands after H steps)", OVERLAP_ON)),
            Row(swarm("robust off", ROBUST_OFF)),
            Row(swarm("robust clip 1 (the old default)", CLIP_1)),
            Row(swarm("the old defaults (overlap on, clip 1)", OVERLAP_ON, CLIP_1), real=True),
        ],
        "outer": [
            Row(swarm("Nesterov 0.7 / 0.9", ROBUST_OFF)),
            Row(swarm("plain averaging (lr 1, no momentum)", ROBUST_OFF, PLAIN_OUTER)),
            Row(swarm("outer SGD lr 0.7, no momentum", ROBUST_OFF, {"outer": {"momentum": 0.0, "nesterov": False}})),
            Row(swarm("Nesterov 0.8 / 0.8", ROBUST_OFF, {"outer": {"lr": 0.8, "momentum": 0.8}})),
        ],
        "outer-lr": [
            Row(
                swarm(
                    f"H={h}, Nesterov lr {lr} / 0.9", ROBUST_OFF, {"rounds": {"inner_steps": h}, "outer": {"lr": lr}}
                ),
                H / h,
                4,
                h,
            )
            for h in (5, 20)
            for lr in (0.3, 0.5, 0.7, 1.0)
        ],
        "lr": [
            Row(swarm(f"inner lr {lr:g}", lr_layer), shared=lr_layer)
            for lr in (1e-3, 2e-3, 4e-3)
            for lr_layer in ({"inner": {"lr": lr}},)
        ],
        "horizon": [Row(swarm("swarm of 4, defaults"), HORIZON_SCALE)],
        "batch": [
            Row(swarm(f"defaults, batch {b} per member", {"inner": {"batch_size": b}}), batch=b) for b in (2, 8, 32)
        ],
        "diagnose": [
            Row(swarm("H=20, plain averaging, no codec", BARE)),
            Row(
                swarm("H=1, plain averaging, no codec", BARE, {"rounds": {"inner_steps": 1}}, EVAL_20),
                H,
                4,
                1,
                shared=EVAL_20,
            ),
        ],
        "hk": [
            *(
                Row(swarm(f"k=4, H={h}", ROBUST_OFF, {"rounds": {"inner_steps": h}}), H / h, 4, h)
                for h in (5, 10, 20, 40)
            ),
            *(Row(swarm(f"k={k}, H=20", ROBUST_OFF, k=k), 4 / k, k) for k in (2, 8)),
        ],
        "codec": [
            *(
                Row(swarm(f"codec {codec}", ROBUST_OFF, {"averaging": {"compression": codec}}), real=True)
                for codec in ("none", "int8", "4bit")
            ),
            Row(swarm("codec none, outer lr 1", ROBUST_OFF, OUTER_LR_1, {"averaging": {"compression": "none"}})),
            Row(swarm("codec sparse 1/4, outer lr 1", ROBUST_OFF, OUTER_LR_1, SPARSE), real=True),
            Row(swarm("codec sparse 1/4", ROBUST_OFF, SPARSE)),
            Row(
                swarm("codec sparse 1/8, outer lr 1", ROBUST_OFF, OUTER_LR_1, SPARSE, {"averaging": {"density": 1 / 8}})
            ),
            Row(
                swarm("codec sparse 1/2, outer lr 1", ROBUST_OFF, OUTER_LR_1, SPARSE, {"averaging": {"density": 1 / 2}})
            ),
            Row(swarm(TOPK, ROBUST_OFF, SPARSELOCO_OUTER, reference_codec="topk")),
        ],
        "overlap": [
            Row(swarm("overlap off", ROBUST_OFF)),
            Row(swarm("overlap, lands after H steps", ROBUST_OFF, OVERLAP_ON)),
            Row(swarm("overlap, eager start, lands after H steps", ROBUST_OFF, EAGER)),
            Row(swarm("overlap, lands after H/4 steps", ROBUST_OFF, OVERLAP_ON, delay_steps=H // 4)),
            Row(swarm("overlap, eager start, lands after H/4 steps", ROBUST_OFF, EAGER, delay_steps=H // 4)),
        ],
        "overlap-h": [
            Row(
                swarm(f"H={h}, {label}", ROBUST_OFF, {"rounds": {"inner_steps": h}}, *layers, delay_steps=d),
                H / h,
                4,
                h,
            )
            for h in (10, 20, 40)
            for label, layers, d in (
                ("overlap off", (), None),
                ("overlap, lands after 2 steps", (OVERLAP_ON,), 2),
                ("overlap, eager start, lands after 2 steps", (EAGER,), 2),
                *(((f"overlap, lands after H/4 = {h // 4} steps", (OVERLAP_ON,), h // 4),) if h // 4 != 2 else ()),
            )
        ],
        "overlap-start": [
            Row(swarm(label, ROBUST_OFF, *layers, delay_steps=d, **ref))
            for label, layers, d, ref in (
                ("overlap off", (), None, {}),
                ("lands after 1 step", (OVERLAP_ON,), 1, {}),
                ("lands after 2 steps (starts at its own end point)", (OVERLAP_ON,), 2, {}),
                ("lands after 2 steps, starts at θ̂ (eager)", (EAGER,), 2, {}),
                ("lands after 2 steps, starts at θ_g", (EAGER,), 2, {"reference_start": "global"}),
                ("lands after 2 steps, starts at θ_g's momentum step", (EAGER,), 2, {"reference_start": "momentum"}),
                ("lands after 2 steps, starts halfway (own Δ, momentum)", (EAGER,), 2, {"reference_start": "half"}),
                ("lands after 2 steps, Streaming DiLoCo's mix α = 0.5", (OVERLAP_ON,), 2, {"reference_mix": 0.5}),
            )
        ],
        "overlap-defaults": [
            Row(swarm(f"H=30, {label}", {"rounds": {"inner_steps": 30}}, *layers, delay_steps=d), H / 30, 4, 30)
            for label, layers, d in (
                ("overlap off (the shipped defaults)", (), None),
                ("overlap, lands after 1 step", (OVERLAP_ON,), 1),
                ("overlap, lands after 2 steps", (OVERLAP_ON,), 2),
                ("overlap, lands after 3 steps", (OVERLAP_ON,), 3),
                ("fragments in turn (2), each lands after 1 step", (IN_TURN,), 1),
                ("fragments in turn (2), each lands after 2 steps", (IN_TURN,), 2),
            )
        ],
        "scale": [
            Row(swarm(f"k=4, d_model {d}", ROBUST_OFF, model), shared=model)
            for d in (32, 64, 128)
            for model in ({"task.model": {"d_model": d}},)
        ],
        "partial": [
            Row(swarm(f"each update left out of {int(100 * p)}% of rounds", drop=p)) for p in (0.0, 0.1, 0.3, 0.5)
        ],
        "robust": [
            row
            for k in (2, 4, 8)
            for row in (
                Row(swarm(f"k={k}, robust on", k=k), 1.0, k),
                Row(swarm(f"k={k}, robust off", ROBUST_OFF, k=k), 1.0, k),
            )
        ],
    }


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _in_process(job: tuple[str, Setup, int, int]) -> RunResult:
    base, setup, seed, rounds = job
    torch.set_num_threads(1)
    return run_inprocess(base, setup, seed=seed, rounds=rounds)


def run_suite(
    name: str,
    rows: list[Row],
    *,
    seeds: list[int],
    rounds: int,
    base: str,
    swarm: bool,
    log: Callable[[str], None],
    pool: Executor | None = None,
) -> dict[str, Any]:
    """Every row and its references over ``seeds``; the suite's summary. In-process runs go
    to ``pool`` where given, all submitted at once (each is a pure function of its spec and
    seed, so where it runs changes nothing), else run one after another as they are needed;
    real swarms run only once every in-process run is done (nothing beside them: they depend
    on timing)."""
    references: dict[tuple[str, int], list[Callable[[], RunResult]]] = {}

    def submit(setup: Setup, n_rounds: int) -> list[Callable[[], RunResult]]:
        jobs = [(base, setup, s, n_rounds) for s in seeds]
        if pool is None:
            return [functools.cache(functools.partial(_in_process, job)) for job in jobs]
        return [pool.submit(_in_process, job).result for job in jobs]

    def reference(setup: Setup, n_rounds: int) -> list[Callable[[], RunResult]]:
        key = (setup.name + str(setup.overrides), n_rounds)
        if key not in references:
            references[key] = submit(setup, n_rounds)
        return references[key]

    def collect(label: str, runs: list[Callable[[], RunResult]]) -> list[RunResult]:
        done = [run() for run in runs]
        if label not in logged:
            logged.add(label)
            log(f"  {label}: {[round(r.final, 4) for r in done]}")
        return done

    logged: set[str] = set()
    planned = []
    for row in rows:
        n_rounds = max(1, round(rounds * row.rounds_scale))
        dp_setup, alone_setup = sync_dp(row.k, row.h, row.shared, row.batch), one_peer(row.h, row.shared, row.batch)
        planned.append(
            (
                row,
                n_rounds,
                submit(row.setup, n_rounds),
                (f"{dp_setup.name}, {n_rounds} rounds", reference(dp_setup, n_rounds)),
                (f"{alone_setup.name}, {n_rounds} rounds", reference(alone_setup, n_rounds)),
            )
        )
    out_rows = []
    for row, n_rounds, runs, dp, alone in planned:
        out_rows.append(_summary(row, n_rounds, collect(row.setup.name, runs), collect(*dp), collect(*alone)))
    for entry, (row, n_rounds, _runs, dp, alone) in zip(out_rows, planned, strict=True):
        if swarm and row.real:
            real = [run_swarm(base, row.setup, seed=s, rounds=n_rounds) for s in seeds]
            log(f"  {row.setup.name} (real swarm): {[round(r.final, 4) for r in real]}")
            entry["swarm"] = _summary(row, n_rounds, real, collect(*dp), collect(*alone))
            # run-to-run noise of the real swarm: the first seed again (in process it is 0)
            again = run_swarm(base, row.setup, seed=seeds[0], rounds=n_rounds)
            entry["swarm"]["repeat"] = {"seed": seeds[0], "first": real[0].final, "again": again.final}
            log(f"  {row.setup.name} (real swarm, seed {seeds[0]} again): {again.final:.4f}")
    return {"suite": name, "rows": out_rows}


def _summary(
    row: Row, n_rounds: int, runs: list[RunResult], dp: list[RunResult], alone: list[RunResult]
) -> dict[str, Any]:
    mean, sd = _mean_sd([r.final for r in runs])
    dp_mean, dp_sd = _mean_sd([r.final for r in dp])
    alone_mean, alone_sd = _mean_sd([r.final for r in alone])
    # per seed: the same data seed and model init in the swarm and its references
    finals = [r.final for r in runs]
    return {
        "name": row.setup.name,
        "k": row.k,
        "h": row.h,
        "rounds": n_rounds,
        "final": mean,
        "final_sd": sd,
        "sync_dp": dp_mean,
        "sync_dp_sd": dp_sd,
        "one_peer": alone_mean,
        "one_peer_sd": alone_sd,
        "vs_sync_dp_pct": _gap(finals, [d.final for d in dp]),
        "vs_one_peer_pct": _gap(finals, [a.final for a in alone]),
        "better_than_one_peer": sum(f < a.final for f, a in zip(finals, alone, strict=True)),
        "runs": [r.as_dict() for r in runs],
        "references": {"sync_dp": [r.as_dict() for r in dp], "one_peer": [r.as_dict() for r in alone]},
    }


def _against_fp32(rows: list[dict[str, Any]]) -> list[str]:
    """For a suite with a ``codec none`` row: each row's loss and averaging bytes per member
    and round against fp32's (per seed: the same data and model init), in process and, where
    run, in the real swarm."""
    lines: list[str] = []
    for label, kind in (("in process", None), ("real swarm", "swarm")):
        entries = [row if kind is None else row.get(kind) for row in rows]
        base = next((e for e in entries if e is not None and e["name"] == "codec none"), None)
        if base is None:
            continue
        lines += [
            f"Against fp32 ({label}):",
            "",
            "| run | val loss vs fp32 | bytes per member and round | of fp32's |",
            "|---|---|---|---|",
        ]
        fp32_bytes = statistics.mean(r["bytes_per_member_round"] or 0.0 for r in base["runs"])
        for entry in entries:
            if entry is None:
                continue
            gap, sd = _gap([r["final"] for r in entry["runs"]], [r["final"] for r in base["runs"]])
            moved = statistics.mean(r["bytes_per_member_round"] or 0.0 for r in entry["runs"])
            share = f"{100 * moved / fp32_bytes:.2f}%" if fp32_bytes else "-"
            lines.append(f"| {entry['name']} | {gap:+.2f}% ± {sd:.2f} | {moved:,.0f} | {share} |")
        lines.append("")
    return lines


def markdown(results: list[dict[str, Any]], command: str, seeds: list[int]) -> str:
    lines = [
        "# Training quality: the swarm against one peer and synchronous data parallel",
        "",
        f"Command: `{command}` ({platform.machine()}, {torch.get_num_threads()} torch thread per trainer; "
        f"data seeds {', '.join(map(str, seeds))}: mean ± sd over seeds; the per-seed ratio's mean ± sd).",
        "",
    ]
    for suite in results:
        lines += [
            f"## {suite['suite']}",
            "",
            "| run | k | H | rounds | val loss | sync DP | one peer | vs sync DP | vs one peer | seeds better than one peer |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in suite["rows"]:
            for label, entry in (("", row), (" (real swarm)", row.get("swarm"))):
                if entry is None:
                    continue
                vs_dp, vs_alone = entry["vs_sync_dp_pct"], entry["vs_one_peer_pct"]
                lines.append(
                    f"| {entry['name']}{label} | {entry['k']} | {entry['h']} | {entry['rounds']} | "
                    f"{entry['final']:.4f} ± {entry['final_sd']:.4f} | {entry['sync_dp']:.4f} | {entry['one_peer']:.4f} | "
                    f"{vs_dp[0]:+.2f}% ± {vs_dp[1]:.2f} | {vs_alone[0]:+.2f}% ± {vs_alone[1]:.2f} | "
                    f"{entry['better_than_one_peer']} of {len(entry['runs'])} |"
                )
        lines.append("")
        repeats = [(row["name"], row["swarm"]["repeat"]) for row in suite["rows"] if "repeat" in row.get("swarm", {})]
        for name, rep in repeats:
            change = 100 * (rep["again"] / rep["first"] - 1)
            lines.append(
                f"Run-to-run noise, {name} (real swarm, seed {rep['seed']} twice): "
                f"{rep['first']:.4f} then {rep['again']:.4f} ({change:+.2f}%)."
            )
        if repeats:
            lines.append("")
        lines += _against_fp32(suite["rows"])
        lines += _gap_over_rounds(suite["rows"])
    lines += [
        "In process a run is a pure function of its spec and data seed (model init and data order",
        "derive from them; `tests/unit/test_training_quality_bench.py`): the same seed twice gives",
        "the same curve, so the spread above is the seeds'. A real swarm also depends on timing",
        "(which members make each round's group, where a time budget or a late start cuts a phase).",
        "",
    ]
    return "\n".join(lines)


def _gap_over_rounds(rows: list[dict[str, Any]]) -> list[str]:
    """For rows of 60 rounds or more: the per-seed gaps read off the curves at an eighth, a
    quarter, half and all of the run."""
    lines: list[str] = []
    for row in rows:
        n = row["rounds"]
        if n < 60 or any(len(run["val_loss"]) < n for run in row["runs"]):  # long, validated every round
            continue
        lines += [
            f"{row['name']}, read off its curves (same seeds):",
            "",
            "| round | inner steps | swarm | sync DP | one peer | vs sync DP | vs one peer | one peer vs sync DP |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted({n // 8, n // 4, n // 2, n}):
            swarm_, dp, alone = (
                [run["val_loss"][r - 1] for run in runs]
                for runs in (row["runs"], row["references"]["sync_dp"], row["references"]["one_peer"])
            )
            vs_dp, vs_alone, alone_dp = _gap(swarm_, dp), _gap(swarm_, alone), _gap(alone, dp)
            lines.append(
                f"| {r} | {r * row['h']} | {statistics.fmean(swarm_):.4f} | {statistics.fmean(dp):.4f} | "
                f"{statistics.fmean(alone):.4f} | {vs_dp[0]:+.2f}% ± {vs_dp[1]:.2f} | "
                f"{vs_alone[0]:+.2f}% ± {vs_alone[1]:.2f} | {alone_dp[0]:+.2f}% ± {alone_dp[1]:.2f} |"
            )
        lines.append("")
    return lines


def _gap(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and sd over seeds of a's excess over b in percent (seed by seed)."""
    return _mean_sd([100 * (x / y - 1) for x, y in zip(a, b, strict=True)])


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install .[bench]): no plot")
        return None
    headline = next((s for s in results if s["suite"] == "headline"), results[0])
    fig, ax = plt.subplots(figsize=(8, 5))
    first = headline["rows"][0]
    for label, runs in (("sync DP", first["references"]["sync_dp"]), ("one peer", first["references"]["one_peer"])):
        ax.plot(range(1, len(runs[0]["val_loss"]) + 1), _mean_curve(runs), "--", label=label)
    for row in headline["rows"]:
        ax.plot(range(1, len(row["runs"][0]["val_loss"]) + 1), _mean_curve(row["runs"]), label=row["name"])
    ax.set_xlabel("round")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title(f"suite {headline['suite']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(runs: list[dict[str, Any]]) -> list[float]:
    n = min(len(r["val_loss"]) for r in runs)
    return [statistics.fmean(r["val_loss"][i] for r in runs) for i in range(n)]


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` worker processes for in-process runs, started fresh (spawn): a process forked
    from one whose torch already runs threads can crash in its first op (a segfault in an
    embedding seen in a fresh-clone run), and one torch thread each, as local peers run."""
    import multiprocessing

    return ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads, initargs=(1,)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="headline", help=f"comma-separated, of: {', '.join(suites())}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of H=20 inner steps (fewer or more for H != 20)")
    parser.add_argument(
        "--swarm", action="store_true", help="also run the rows marked real (headline, codec) as real local swarms"
    )
    parser.add_argument("--row", action="append", default=[], help="run only the rows of this name (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="training-quality")
    parser.add_argument(
        "--jobs", type=int, default=1, help="in-process runs side by side (one torch thread each; results unchanged)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    known = suites()
    wanted = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in known]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {list(known)}")
    if args.row:
        known = {name: [r for r in rows if r.setup.name in args.row] for name, rows in known.items()}
        missing = set(args.row) - {r.setup.name for name in wanted for r in known[name]}
        if missing:
            parser.error(f"no row named {sorted(missing)} in suite(s) {wanted}")
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)  # several trainers share the cores, one thread each (as local peers run)
    base = BASE.read_text()
    command = "python -m benchmarks.training_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    results = []
    pool = worker_pool(args.jobs) if args.jobs > 1 else None
    try:
        for name in wanted:
            print(f"suite {name}:", flush=True)
            results.append(
                run_suite(
                    name,
                    known[name],
                    seeds=seeds,
                    rounds=args.rounds,
                    base=base,
                    swarm=args.swarm,
                    log=print,
                    pool=pool,
                )
            )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"command": command, "seeds": seeds, "suites": results}, indent=1)
    )
    (args.out / f"{args.name}.md").write_text(markdown(results, command, seeds))
    plot(results, args.out / f"{args.name}.png")
    print(markdown(results, command, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
