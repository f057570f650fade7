"""The codecs' speed: the compiled kernels (``engine.kernels``) against the torch
reference (``Codec.reference()``), in one run, on the same vector.

For each codec and operation (``encode``, the reducer's stochastic ``encode_unbiased``,
``decode``, the error feedback's ``roundtrip``) it times the best of ``--reps`` passes over a
vector of ``--values`` float32 values, cut as a round cuts it (the all-reduce's parts for the
codecs, the error feedback's chunks for the roundtrip), and reports GB of float32 per second
(4 bytes a value, whatever the codec writes) and the ratio. The reference runs on one torch thread, as the
peer's averager does (``torch.set_num_threads(1)`` in ``benchmarks.wan_averaging``'s hosts);
the kernels on one thread and then on ``--threads``. Both paths are checked to give the same
bytes before anything is timed.

    python -m benchmarks.codec_speed --values 33554432 --reps 5 --label 32M

writes ``benchmarks/results/codec-speed[-LABEL].{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.allreduce import part_size_bytes
from engine.codecs import get_codec
from engine.compression import KERNELS_ENV, Codec, compiled_kernels
from peer.round.state import CHUNK_VALUES

CODECS = ("fp16", "int8", "4bit", "sparse")
OPS = ("encode", "encode_unbiased", "decode", "roundtrip")


def best_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: compiled code loaded, pages touched
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def calls(codec: Codec, x: torch.Tensor, dither: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each operation over ``x`` as a round runs it: encode and decode part by part (the
    all-reduce's parts, ``engine.allreduce.part_size_bytes`` for a group of 4), the roundtrip
    chunk by chunk (the error feedback's windows, ``peer.round.state.CHUNK_VALUES``)."""
    part = int(part_size_bytes(x.numel(), codec, 4) / codec.bytes_per_value())
    parts = [x[i : i + part] for i in range(0, x.numel(), part)]
    encoded = [codec.encode(p) for p in parts]
    windows = [x[i : i + CHUNK_VALUES] for i in range(0, x.numel(), CHUNK_VALUES)]

    def each(fn: Callable[[Any], object], items: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for item in items:
                fn(item)  # and dropped, as the all-reduce drops a part once it is sent

        return run

    return {
        "encode": each(codec.encode, parts),
        "encode_unbiased": each(lambda p: codec.encode_unbiased(p, dither), parts),
        "decode": each(lambda pair: codec.decode(pair[0], pair[1].numel()), list(zip(encoded, parts))),
        "roundtrip": each(codec.roundtrip, windows),
    }


def measure(values: int, reps: int, threads: int) -> list[dict[str, Any]]:
    os.environ.setdefault(KERNELS_ENV, "on")  # whatever the length (a process takes them only when told or chosen)
    compiled_kernels.cache_clear()
    if compiled_kernels() is None:
        raise SystemExit("the compiled kernels are off (SWARMTRAIN_CODEC_KERNELS=off): nothing to compare")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(values, generator=generator)
    dither = torch.rand(values + 4096, generator=generator)
    gb = values * 4 / 1e9
    rows = []
    for name in CODECS:
        compiled = get_codec(name).at_round(1)
        reference = compiled.reference()
        if compiled.encode(x) != reference.encode(x):
            raise SystemExit(f"{name}: the kernels' bytes differ from the reference's")
        torch.set_num_threads(1)
        os.environ["SWARMTRAIN_CODEC_THREADS"] = "1"
        ref_calls, one_calls = calls(reference, x, dither), calls(compiled, x, dither)
        for op in OPS:
            ref_s, one_s = best_s(ref_calls[op], reps), best_s(one_calls[op], reps)
            os.environ["SWARMTRAIN_CODEC_THREADS"] = str(threads)
            many_s = best_s(one_calls[op], reps)
            os.environ["SWARMTRAIN_CODEC_THREADS"] = "1"
            rows.append(
                {
                    "codec": name,
                    "op": op,
                    "reference_gbps": gb / ref_s,
                    "kernels_gbps": gb / one_s,
                    "kernels_threads_gbps": gb / many_s,
                    "ratio": ref_s / one_s,
                    "ratio_threads": ref_s / many_s,
                }
            )
            print(
                f"{name:7s} {op:16s} reference {gb / ref_s:6.2f} GB/s | kernels {gb / one_s:6.2f} "
                f"({ref_s / one_s:4.1f}x) | {threads} threads {gb / many_s:6.2f} ({ref_s / many_s:4.1f}x)",
                flush=True,
            )
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"# Codec speed: compiled kernels against the torch reference ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}` on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs): a vector of "
        f"{args.values:,} float32 values in the all-reduce's parts (the roundtrip in the error feedback's "
        f"chunks), best of {args.reps} passes; GB of float32 per second (4 bytes a value). The reference on one torch thread; the kernels on one thread, then on "
        f"{args.threads}.",
        "",
        "| codec | operation | reference GB/s | kernels GB/s (x reference) "
        f"| kernels, {args.threads} threads, GB/s (x reference) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['op']} | {r['reference_gbps']:.2f} | {r['kernels_gbps']:.2f} ({r['ratio']:.1f}x) "
            f"| {r['kernels_threads_gbps']:.2f} ({r['ratio_threads']:.1f}x) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=1 << 25, help="float32 values in the vector")
    parser.add_argument("--reps", type=int, default=5, help="calls timed per operation (the best counts)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the kernels' threads, second run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--label", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    if args.values < 1 or args.reps < 1 or args.threads < 1:
        parser.error("--values, --reps and --threads must be at least 1")
    command = "python -m benchmarks.codec_speed " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = measure(args.values, args.reps, args.threads)
    stem = "codec-speed" + (f"-{args.label}" if args.label else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(markdown(rows, args, command.strip()))
    (args.out / f"{stem}.json").write_text(
        json.dumps({"values": args.values, "reps": args.reps, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out / stem}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
