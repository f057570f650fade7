#!/usr/bin/env bash
# Issue #29's GPU checks that need no data: the inner-step throughput of a spec in several
# variants (micro-batches : activation checkpointing : torch.compile), optionally the same
# measure at a baseline tree (BASE_DIR: e.g. `git archive <ref> | tar -x -C .device/base`), one
# profiled run (GPU time by kind of kernel), and the local-ranks smoke run (a node of
# --nproc-per-node 1 ranks, FSDP2 and DDP over NCCL, beside a 1-rank partner).
#   device run(carry=[".device"], command="bash benchmarks/gpu/mfu_run.sh")
# Knobs: SPEC=examples/llama-1b.toml LABEL=<gpu>-llama-1b VARIANTS="1:off:off 1:off:on"
#   BASE_VARIANTS="1:off:off" PROFILE=1:off:on STEPS=10 PEAK_TFLOPS=989 SMOKE=1 SKIP_INSTALL=0
#   BUDGET_S=560. Everything lands in $OUT/mfu.tgz (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD START=$(date +%s)
: "${OUT:=/tmp/mfu-out}" "${SPEC:=examples/llama-1b.toml}" "${STEPS:=10}" "${PEAK_TFLOPS:=989}"
: "${VARIANTS:=1:off:off 1:off:on}" "${BASE_DIR:=}" "${BASE_VARIANTS:=1:off:off}" "${PROFILE:=}"
: "${SMOKE:=1}" "${SKIP_INSTALL:=0}" "${BUDGET_S:=560}" "${PYTHON:=python3}"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'H' 'h')
: "${LABEL:=${GPU:-cpu}-$(basename "$SPEC" .toml)}"
RES=$OUT/res && mkdir -p "$RES"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
say() { echo "[$(($(date +%s) - START)) s] $*"; }
pack() { tar -C "$OUT" -czf "$OUT/mfu.tgz" res; }
trap pack EXIT
if [ "$SKIP_INSTALL" != 1 ]; then
    SWARMTRAIN_SKIP_DHT=1 bash benchmarks/gpu/install.sh >"$RES/install.log" 2>&1 || { tail -30 "$RES/install.log"; exit 1; }
fi
nvidia-smi >"$RES/machine.txt" 2>&1; "$PYTHON" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' >>"$RES/machine.txt" 2>&1
measure() {  # DIR VARIANT [--profile]: one lm_throughput run in tree DIR
    local dir=$1 variant=$2 extra=${3:-} tag mb ck co
    IFS=: read -r mb ck co <<<"$variant"
    tag="$LABEL-mb$mb-ckpt$ck${co:+$([ "$co" = on ] && echo -compile)}"
    [ "$dir" != "$ROOT" ] && tag+="-base"
    [ -n "$extra" ] && tag+="-profile"
    local args=(--micro-batches "$mb" --activation-checkpointing "$ck")
    [ "$co" = on ] && args+=(--compile on)
    [ "$(left)" -lt 100 ] && { say "skip $tag: $(left) s left"; return; }
    say "throughput $tag"
    (cd "$dir" && PYTHONPATH="$dir" timeout -k 5 $(( $(left) - 60 )) "$PYTHON" -m benchmarks.lm_throughput --spec "$SPEC" \
        --steps "$STEPS" --label "$tag" --peak-tflops "$PEAK_TFLOPS" "${args[@]}" $extra >"$RES/$tag.log" 2>&1)
    echo "exit $?"
    cp "$dir"/benchmarks/results/lm-throughput-*-"$tag".* "$RES/" 2>/dev/null
    grep -E '"(tokens_per_s|mfu|peak_gpu_gib|step_s|init_s)"' "$RES/$tag.log" | tr -d '\n '; echo
}
if [ -n "$BASE_DIR" ]; then for v in $BASE_VARIANTS; do measure "$(cd "$BASE_DIR" && pwd)" "$v"; done; fi
for v in $VARIANTS; do measure "$ROOT" "$v"; done
[ -n "$PROFILE" ] && measure "$ROOT" "$PROFILE" --profile && grep -A12 gpu_ms_by_kind "$RES"/*-profile.log | head -14
if [ "$SMOKE" = 1 ] && [ "$(left)" -gt 60 ]; then
    say "local ranks smoke (--nproc-per-node 1, FSDP2 and DDP)"
    timeout -k 5 $(( $(left) - 10 )) "$PYTHON" -m benchmarks.gpu.node_smoke --out "$RES/smoke" --rounds 3 2>&1 | tail -4
fi
say done
