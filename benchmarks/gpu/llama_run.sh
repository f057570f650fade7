#!/bin/bash
# Issue #15's GPU check: examples/llama-1b.toml on one lent GPU, in one device command:
#
#   device tool: run(carry=[".device"], command="bash benchmarks/gpu/llama_run.sh")
#
# (after `bash benchmarks/gpu/build_wheels.sh` here). On the device it
#   0. installs the carried wheels (install.sh) and records nvidia-smi, free, nproc;
#   a. measures inner-step throughput of the spec's model on random tokens
#      (`python3 -m benchmarks.lm_throughput --spec $SPEC --steps 10`: bf16 autocast,
#      micro-batches and activation checkpointing as the spec says) -> $OUT/lm-throughput-*.{md,json};
#   b. meanwhile trains a BPE tokenizer on the standard library and prepares it into token shards
#      (`swarmtrain data tokenizer|prepare`), then runs a real swarm of 2 standalone peers of the
#      spec's model on the one GPU for $ROUNDS rounds (a copy of the spec with the data's digests,
#      2 data slots, $INNER_STEPS inner steps, 4-bit averaging, validation every round), sampling
#      nvidia-smi and each peer's host memory every second -> $OUT/llama_swarm.{json,md}, the peers'
#      metrics (peer*.jsonl) and logs, gpu_samples.csv.
# Whole script: about 6-8 minutes, never more than $BUDGET_S seconds (each step has a `timeout`).
#
# Knobs (environment), defaults for the GPU run; the CPU check of the same logic here is
#   OUT=/tmp/llama-out WORK=/tmp/llama-work SKIP_INSTALL=1 PYTHON=.venv/bin/python \
#   SPEC=examples/llama-tiny.toml SEQ_LEN=64 VOCAB=2048 ROUNDS=2 INNER_STEPS=10 CORPUS_FILES=160 \
#   nice -n 19 bash benchmarks/gpu/llama_run.sh
#   SPEC=examples/llama-1b.toml  the run spec (a causal_lm task over prepared tokens)
#   SEQ_LEN=2048 VOCAB=8192      `data prepare --seq-len` (must equal the spec's seq_len), tokenizer size
#   ROUNDS=3 INNER_STEPS=20      rounds of the swarm, inner steps per round
#   EVAL_BATCHES=4               validation batches per round ([eval] batches)
#   MATCHMAKING_S=30 ALLREDUCE_S=180 COMPRESSION=4bit   [averaging] of the swarm's spec
#   WARMUP_TOKENS=<one round>    [schedule] warmup_tokens (the example's 500M would keep lr ~0 here)
#   CORPUS_FILES=                the first N standard-library files only (default: all of them)
#   THROUGHPUT_STEPS=10 LABEL=<gpu>-<spec>  step a; PEAK_TFLOPS=989 (H100/H200 SXM dense bf16)
#   MICRO_BATCHES=               the swarm's micro_batches (default: the spec's, doubled when step a's
#                                peak GPU memory says two peers would not fit on the GPU)
#   BUDGET_S=540                 the whole script's deadline (the device allows 600 s a command)
#   THROUGHPUT_VARIANTS="2:off 1:off:on"   step a again for each MICRO_BATCHES:CHECKPOINTING[:COMPILE] (on|off)
#   PROFILE_VARIANT=1:off:on     step a once more with --profile (GPU time by kind of kernel)
#   PEER_ARGS="--overlap --compile on"   extra `swarmtrain peer` flags for both peers of step b
#   DOCTOR=1                     also `swarmtrain doctor --spec $SPEC --skip-network` -> $OUT/doctor.txt
#   SKIP_INSTALL=1 SKIP_THROUGHPUT=1 SKIP_SWARM=1   leave a step out; PYTHON=python3
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
START=$(date +%s)
: "${BUDGET_S:=540}"
: "${OUT:=/tmp/llama-run-out}"
: "${WORK:=/tmp/llama-run}"
: "${PYTHON:=python3}"
: "${SPEC:=examples/llama-1b.toml}"
: "${SEQ_LEN:=2048}"
: "${VOCAB:=8192}"
: "${ROUNDS:=3}"
: "${INNER_STEPS:=20}"
: "${EVAL_BATCHES:=4}"
: "${MATCHMAKING_S:=30}"
: "${ALLREDUCE_S:=180}"
: "${COMPRESSION:=4bit}"
: "${WARMUP_TOKENS:=}"
: "${CORPUS_FILES:=}"
: "${THROUGHPUT_STEPS:=10}"
: "${SKIP_INSTALL:=0}"
: "${SKIP_THROUGHPUT:=0}"
: "${SKIP_SWARM:=0}"
: "${THROUGHPUT_VARIANTS:=}"
: "${PROFILE_VARIANT:=}"
: "${PEER_ARGS:=}"
: "${DOCTOR:=0}"
PY=$PYTHON
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PEER_ARGS OUT WORK SPEC SEQ_LEN ROUNDS INNER_STEPS EVAL_BATCHES MATCHMAKING_S ALLREDUCE_S COMPRESSION WARMUP_TOKENS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# nothing is downloaded at run time (the device has no network anyway)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
# cap N [RESERVE]: N seconds, or what is left of the budget less RESERVE if that is less (>= 1)
cap() {
    local c=$1 l
    l=$(($(left) - ${2:-0}))
    ((l < c)) && c=$l
    ((c < 1)) && c=1
    echo "$c"
}
say() { echo "== [$(($(date +%s) - START)) s] $*"; }

GPU=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && GPU=1

if [ "$SKIP_INSTALL" != 1 ]; then
    say "install.sh"
    ALLOW_CPU=$((1 - GPU))
    if ! SWARMTRAIN_SKIP_DHT=1 SWARMTRAIN_ALLOW_CPU=$ALLOW_CPU timeout -k 5 "$(cap 180 300)" \
        bash benchmarks/gpu/install.sh >"$OUT/install.log" 2>&1; then
        tail -30 "$OUT/install.log"
        echo "llama_run.sh: install.sh failed (see install.log)"
        exit 1
    fi
    tail -3 "$OUT/install.log"
fi

say "machine"
{
    if [ "$GPU" = 1 ]; then nvidia-smi; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
    free -g
    echo "nproc: $(nproc)"
    "$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
} >"$OUT/machine.txt" 2>&1
grep -E "^(name|Mem:|nproc|3\.)|, [0-9]+ MiB" "$OUT/machine.txt" | head -8
GPU_NAME=$([ "$GPU" = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || echo cpu)
case "$GPU_NAME" in
*H100*PCIe*) : "${PEAK_TFLOPS:=756}" ;;
*) : "${PEAK_TFLOPS:=989}" ;;
esac
SHORT=$(echo "$GPU_NAME" | grep -oiE 'h100|h200|a100|l40s|cpu' | head -1 | tr 'A-Z' 'a-z')
: "${LABEL:=${SHORT:-gpu}-$(basename "$SPEC" .toml)}"
export PEAK_TFLOPS LABEL GPU_NAME

# b (first half), in the background while a runs: tokenizer and token shards of the stdlib
DATA_PID=
if [ "$SKIP_SWARM" != 1 ]; then
    say "data: tokenizer (vocabulary $VOCAB) and shards (seq_len $SEQ_LEN) of the standard library, in the background"
    (
        MAX=()
        [ -n "$CORPUS_FILES" ] && MAX=(--max-files "$CORPUS_FILES")
        mapfile -t FILES < <("$PY" -c 'import sys; from swarmtrain.dataprep import stdlib_corpus
print("\n".join(map(str, stdlib_corpus(int(sys.argv[1]) if sys.argv[1] else None))))' "$CORPUS_FILES")
        echo "${#FILES[@]} files"
        timeout -k 5 "$(cap 150 240)" "$PY" -m swarmtrain data tokenizer --stdlib "${MAX[@]}" \
            --vocab-size "$VOCAB" --out "$WORK/tokenizer" || exit 1
        timeout -k 5 "$(cap 180 200)" "$PY" -m swarmtrain data prepare "${FILES[@]}" --tokenizer "$WORK/tokenizer" \
            --seq-len "$SEQ_LEN" --out "$WORK/data" --no-progress >"$OUT/prepare.txt" || exit 1
        cat "$OUT/prepare.txt"
    ) >"$OUT/data.log" 2>&1 &
    DATA_PID=$!
fi

if [ "$SKIP_THROUGHPUT" != 1 ]; then
    # the spec as written first (its result, label $LABEL, also sizes the swarm below), then each
    # MICRO:CHECKPOINTING[:COMPILE] variant of THROUGHPUT_VARIANTS (label
    # $LABEL-mbMICRO-ckptCHECKPOINTING[-compile]), then PROFILE_VARIANT with --profile
    for variant in "" $THROUGHPUT_VARIANTS ${PROFILE_VARIANT:+profile:$PROFILE_VARIANT}; do
        ARGS=() TAG=$LABEL
        if [ -n "$variant" ]; then
            PROF=""
            case "$variant" in profile:*) PROF=1 variant=${variant#profile:} ;; esac
            IFS=: read -r MB CK CO <<<"$variant"
            ARGS=(--micro-batches "$MB" --activation-checkpointing "$CK")
            TAG="$LABEL-mb$MB-ckpt$CK"
            if [ "${CO:-off}" = on ]; then ARGS+=(--compile on); TAG+="-compile"; fi
            if [ -n "$PROF" ]; then ARGS+=(--profile); TAG+="-profile"; fi
        fi
        say "a. inner-step throughput: $SPEC ${ARGS[*]}, $THROUGHPUT_STEPS steps, label $TAG"
        touch "$WORK/.before-throughput"
        timeout -k 5 "$(cap 240 240)" "$PY" -m benchmarks.lm_throughput --spec "$SPEC" --steps "$THROUGHPUT_STEPS" \
            --label "$TAG" --peak-tflops "$PEAK_TFLOPS" "${ARGS[@]}" >>"$OUT/throughput.log" 2>&1
        echo "exit $?"
        # this run's result files (benchmarks/results/lm-throughput-<date>-$TAG.{md,json})
        mapfile -t MADE < <(find benchmarks/results -maxdepth 1 -name "lm-throughput-*-$TAG.*" -newer "$WORK/.before-throughput")
        if [ "${#MADE[@]}" -gt 0 ]; then
            cp "${MADE[@]}" "$OUT/"
            for f in "${MADE[@]}"; do case "$f" in *.json) tr -d '\n ' <"$f" | head -c 1500; echo ;; esac; done
        else
            tail -20 "$OUT/throughput.log"
        fi
    done
fi

if [ "$DOCTOR" = 1 ]; then
    say "doctor --spec $SPEC --skip-network (the GPU memory verdict and expected contribution)"
    timeout -k 5 "$(cap 150 60)" "$PY" -m swarmtrain doctor --spec "$SPEC" --skip-network >"$OUT/doctor.txt" 2>&1
    echo "exit $?"
    cat "$OUT/doctor.txt"
fi

[ "$SKIP_SWARM" = 1 ] && { say "done (swarm skipped)"; exit 0; }
say "waiting for the data"
if ! wait "$DATA_PID"; then
    tail -20 "$OUT/data.log"
    echo "llama_run.sh: data preparation failed (see data.log)"
    exit 1
fi
tail -6 "$OUT/data.log"

say "b. a swarm of 2 peers, $ROUNDS rounds of $INNER_STEPS inner steps ($(left) s left)"
export SWARM_S=$(($(left) - 40))  # the driver's deadline: then <= 15 s to stop the peers, and the summary
timeout -k 5 "$(cap 600 5)" "$PY" - <<'PY'
"""Write the swarm's spec, run 2 standalone peers on it, sample GPU and host memory, summarise."""
import json, os, re, shutil, statistics, subprocess, sys, threading, time
from pathlib import Path

from benchmarks.scale import pss_bytes
from protocol.modelsize import task_flops_per_sample, task_params
from protocol.spec import load_spec
from swarmtrain.localswarm import LocalPeer

env = os.environ
OUT, WORK = Path(env["OUT"]), Path(env["WORK"])
deadline = time.monotonic() + float(env["SWARM_S"])
errors: list[str] = []
sampler_errors: list[str] = []  # a lost nvidia-smi sample is no failure of the run


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def set_key(text: str, section: str, key: str, value) -> str:
    """``key = value`` in ``[section]`` of a TOML text (replaced, or added; the section too)."""
    lines = text.split("\n")
    head = f"[{section}]"
    starts = [i for i, line in enumerate(lines) if line.strip() == head]
    if not starts:
        lines += ["", head]
        starts = [len(lines) - 1]
    start = starts[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    new = f"{key} = {toml_value(value)}"
    for i in range(start + 1, end):
        if re.match(rf"\s*{re.escape(key)}\s*=", lines[i]):
            lines[i] = new
            break
    else:
        at = end
        while at > start + 1 and not lines[at - 1].strip():
            at -= 1
        lines.insert(at, new)
    return "\n".join(lines)


prepared = (OUT / "prepare.txt").read_text()
digests = {k: re.search(rf"^{k}: (sha256:[0-9a-f]{{64}})$", prepared, re.M) for k in ("manifest", "tokenizer")}
base = load_spec(Path(env["SPEC"]))
lm = base.task.causal_lm
assert lm is not None, "the spec is not a causal_lm task"
if lm.seq_len != int(env["SEQ_LEN"]):
    sys.exit(f"SEQ_LEN={env['SEQ_LEN']} but the spec's seq_len is {lm.seq_len}")
rounds, inner = int(env["ROUNDS"]), int(env["INNER_STEPS"])
has_gpu = bool(shutil.which("nvidia-smi")) and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
# Two peers share the GPU: if step a's peak (one model) says two would not fit, halve the
# micro-batch (activations) of the swarm's spec, and say so in the result (MICRO_BATCHES forces it).
micro, micro_note = env.get("MICRO_BATCHES") or None, None
measured = sorted(OUT.glob(f"lm-throughput-*-{env['LABEL']}.json"))  # the spec as written
if micro is None and has_gpu and measured:
    one = json.loads(measured[-1].read_text())
    total_gib = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True).stdout.split()[0]) / 1024
    need = 2 * ((one.get("peak_gpu_gib") or 0) * 1.15 + 1.5)
    if need > 0.95 * total_gib and base.inner.batch_size % (2 * lm.micro_batches) == 0:
        micro = 2 * lm.micro_batches
        micro_note = f"step a peaked at {one['peak_gpu_gib']} GiB: two peers need ~{need:.0f} of {total_gib:.0f} GiB, micro_batches {lm.micro_batches} -> {micro}"
        print(micro_note, flush=True)
one_round = 2 * inner * base.inner.batch_size * lm.seq_len
edits = {
    "task.causal_lm": {"micro_batches": int(micro)} if micro else {},
    "data": {"path": str(WORK / "data"), "manifest": digests["manifest"].group(1),
             "tokenizer": digests["tokenizer"].group(1), "slots": 2},
    "rounds": {"inner_steps": inner, "max_rounds": rounds},
    "eval": {"every_rounds": 1, "batches": int(env["EVAL_BATCHES"])},
    "schedule": {"warmup_tokens": int(env["WARMUP_TOKENS"] or one_round)},
    "averaging": {"compression": env["COMPRESSION"], "min_group_size": 2,
                  "matchmaking_timeout_s": float(env["MATCHMAKING_S"]),
                  "allreduce_timeout_s": float(env["ALLREDUCE_S"])},
}
text = Path(env["SPEC"]).read_text()
for section, keys in edits.items():
    for key, value in keys.items():
        text = set_key(text, section, key, value)
spec_path = OUT / "llama_swarm.toml"
spec_path.write_text(text)
spec = load_spec(spec_path)  # refuses a bad edit here, not in the peers
flops = task_flops_per_sample(spec)
peak = float(env["PEAK_TFLOPS"]) * 1e12
print(f"spec {spec_path}: {task_params(spec):,} params, {flops:.3e} FLOPs/sample, warmup {edits['schedule']['warmup_tokens']} tokens", flush=True)

# --- samplers: nvidia-smi (utilisation, memory, per-process memory) and host memory, every second
peers: list[LocalPeer] = []
host = {}  # name -> {"rss": peak VmHWM of the peer process, "pss": peak PSS of its process tree}
gpu = {"util": [], "used": [], "per_pid": {}, "apps_seen": 0}
stop = threading.Event()


def peer_of(pid: int):
    for p in peers:
        try:
            if pid == p.proc.pid or os.getpgid(pid) == p.proc.pid:
                return p.name
        except OSError:
            pass
    return None


def sample() -> None:
    csv = (OUT / "gpu_samples.csv").open("w")
    csv.write("t_s,util_pct,mem_used_mib,peer0_mib,peer1_mib,peer0_pss_gib,peer1_pss_gib\n")
    t0 = time.monotonic()
    while not stop.is_set():
        row = {"util": "", "used": "", "peer0": "", "peer1": ""}
        if has_gpu:
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5).stdout.split("\n")[0].split(",")
                row["util"], row["used"] = int(q[0]), int(q[1])
                gpu["util"].append(row["util"])
                gpu["used"].append(row["used"])
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout
                for line in apps.strip().splitlines():
                    pid, mib = (int(x) for x in line.split(","))
                    gpu["apps_seen"] += 1
                    name = peer_of(pid)
                    if name:
                        row[name] = mib
                        gpu["per_pid"][name] = max(gpu["per_pid"].get(name, 0), mib)
            except Exception as exc:  # a sample lost is no reason to stop
                sampler_errors.append(f"nvidia-smi: {exc!r}")
        pss = {}
        for p in list(peers):
            if p.proc.poll() is not None:
                continue
            h = host.setdefault(p.name, {"rss": 0, "pss": 0})
            try:
                status = Path(f"/proc/{p.proc.pid}/status").read_text()
                hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024
                h["rss"] = max(h["rss"], hwm)
                pss[p.name] = pss_bytes(p.proc.pid)
                h["pss"] = max(h["pss"], pss[p.name])
            except (OSError, AttributeError):
                pass
        csv.write(f"{time.monotonic() - t0:.1f},{row['util']},{row['used']},{row['peer0']},{row['peer1']},"
                  + ",".join(f"{pss[n] / 2**30:.2f}" if n in pss else "" for n in ("peer0", "peer1")) + "\n")
        csv.flush()
        stop.wait(1.0)
    csv.close()


sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
threads = max(1, (os.cpu_count() or 2) // 2)
common = ["--spec", str(spec_path), "--host", "127.0.0.1", "--wait-for-group", "300", *env["PEER_ARGS"].split()]
penv = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
started = time.monotonic()
try:
    peers.append(LocalPeer([*common, "--key", str(WORK / "peer0.key"), "--data-slot", "0"], OUT, "peer0",
                           threads=threads, env=penv))
    maddr = peers[0].wait_for_maddr(deadline_s=max(1.0, deadline - time.monotonic()))
    print(f"[{time.monotonic() - started:.0f} s] peer0 listening at {maddr}", flush=True)
    peers.append(LocalPeer([*common, "--key", str(WORK / "peer1.key"), "--data-slot", "1", "--initial-peers", maddr],
                           OUT, "peer1", threads=threads, env=penv))
    seen = 0
    while any(p.proc.poll() is None for p in peers) and time.monotonic() < deadline:
        done = sum(len(p.rounds()) for p in peers)
        if done != seen:
            seen = done
            print(f"[{time.monotonic() - started:.0f} s] rounds done: " + ", ".join(f"{p.name} {len(p.rounds())}" for p in peers), flush=True)
        time.sleep(1.0)
    if any(p.proc.poll() is None for p in peers):
        errors.append(f"deadline: peers still running after {time.monotonic() - started:.0f} s; stopped")
except Exception as exc:
    errors.append(f"{type(exc).__name__}: {exc}")
finally:
    for p in peers:  # done by now, or asked to leave after the current round, then killed
        p.leave()
    end = time.monotonic() + max(5.0, min(15.0, deadline + 15 - time.monotonic()))
    for p in peers:
        p.stop(grace_s=max(1.0, end - time.monotonic()))
    stop.set()
    sampler.join(timeout=10)
elapsed = time.monotonic() - started


def r3(x):
    return None if x is None else round(x, 3)


seq = spec.task.causal_lm.seq_len
on_cuda = False
summary_peers = []
for p in peers:
    device = next((m.group(1) for line in p.lines if (m := re.match(r"^model: [\d,]+ parameters on (\S+?);", line))), None)
    on_cuda = on_cuda or bool(device and device.startswith("cuda"))
    rows = []
    for r in p.rounds():
        compute = r.get("compute_s") or 0.0
        samples = r.get("samples", 0)
        tps = samples * seq / compute if compute else None
        tflops = flops * samples / compute / 1e12 if compute else None
        rows.append({
            "round": r["round"], "samples": samples, "compute_s": r3(compute), "tokens_per_s": r3(tps),
            "tflops_per_s": r3(tflops), "mfu": r3(tflops * 1e12 / peak) if tflops and device and device.startswith("cuda") else None,
            "loss": r3(r.get("loss")), "val_loss": r3(r.get("val_loss")), "lr": r.get("lr"),
            "allreduce_s": r3(r.get("allreduce_s")), "wait_s": r3(r.get("wait_s")), "host_s": r3(r.get("host_s")),
            "wall_s": r3(r.get("wall_s")), "group_size": r.get("group_size"), "averaged": r.get("averaged"),
            "bytes_sent": r.get("bytes_sent"), "state_digest": (r.get("state_digest") or "")[:23], "data": r.get("data"),
        })
    h = host.get(p.name, {})
    summary_peers.append({
        "name": p.name, "exit_code": p.proc.returncode, "device": device, "rounds": rows,
        "host_peak_rss_gib": r3(h.get("rss", 0) / 2**30) if h else None,
        "host_peak_pss_tree_gib": r3(h.get("pss", 0) / 2**30) if h else None,
        "gpu_peak_mib": gpu["per_pid"].get(p.name),
        "log_tail": p.lines[-8:] if p.proc.returncode not in (0, None) or not rows else [],
    })
by_round: dict[int, list] = {}
for sp in summary_peers:
    for row in sp["rounds"]:
        by_round.setdefault(row["round"], []).append(row)
swarm_rounds = []
for rnd, rows in sorted(by_round.items()):
    tps = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
    swarm_rounds.append({
        "round": rnd, "peers": len(rows), "gpu_tokens_per_s": r3(sum(tps)) if tps else None,
        "gpu_mfu": r3(sum(r["mfu"] for r in rows if r["mfu"])) if on_cuda else None,
        "loss": r3(statistics.mean(r["loss"] for r in rows if r["loss"] is not None)) if any(r["loss"] is not None for r in rows) else None,
        "val_loss": next((r["val_loss"] for r in rows if r["val_loss"] is not None), None),
        "digests_equal": len({r["state_digest"] for r in rows}) == 1 and len(rows) == len(peers),
    })
steady = [r for r in swarm_rounds[1:] if r["gpu_tokens_per_s"]] or [r for r in swarm_rounds if r["gpu_tokens_per_s"]]
result = {
    "spec": env["SPEC"], "swarm_spec": str(spec_path.name), "device": env.get("GPU_NAME", "cpu"), "on_cuda": on_cuda,
    "params": task_params(spec), "flops_per_sample": flops, "peak_tflops": float(env["PEAK_TFLOPS"]),
    "seq_len": seq, "batch_size": spec.inner.batch_size, "micro_batches": spec.task.causal_lm.micro_batches,
    "activation_checkpointing": spec.task.causal_lm.activation_checkpointing, "micro_batches_note": micro_note,
    "inner_steps": inner,
    "rounds_planned": rounds, "compression": spec.averaging.compression, "overlap": spec.averaging.overlap,
    "elapsed_s": round(elapsed, 1),
    "steady_gpu_tokens_per_s": r3(statistics.median(r["gpu_tokens_per_s"] for r in steady)) if steady else None,
    "steady_gpu_mfu": r3(statistics.median(r["gpu_mfu"] for r in steady)) if steady and on_cuda else None,
    "gpu_mem_used_peak_mib": max(gpu["used"]) if gpu["used"] else None,
    "gpu_util_mean_pct": r3(statistics.mean(gpu["util"])) if gpu["util"] else None,
    "gpu_per_process_memory": "nvidia-smi compute-apps matched the peers" if gpu["per_pid"] else
        ("no GPU" if not has_gpu else f"compute-apps gave no peer pid ({gpu['apps_seen']} rows: another pid namespace?)"),
    "swarm_rounds": swarm_rounds, "peers": summary_peers, "errors": errors[:20],
    "sampler_errors": len(sampler_errors), "first_sampler_error": sampler_errors[0] if sampler_errors else None,
}
(OUT / "llama_swarm.json").write_text(json.dumps(result, indent=1) + "\n")
md = [f"# {env['SPEC']}: 2 peers on {result['device']}, {rounds} rounds x {inner} inner steps", "",
      "| peer | round | tokens/s | MFU | loss | val_loss | compute_s | allreduce_s | wait_s | host_s | group |", "|" + "---|" * 11]
for sp in summary_peers:
    for r in sp["rounds"]:
        md.append(f"| {sp['name']} | {r['round']} | {r['tokens_per_s']} | {r['mfu']} | {r['loss']} | {r['val_loss']} | "
                  f"{r['compute_s']} | {r['allreduce_s']} | {r['wait_s']} | {r['host_s']} | {r['group_size']} |")
md += ["", "| peer | exit | device | host peak RSS GiB | host peak PSS (tree) GiB | GPU peak MiB |", "|---|---|---|---|---|---|"]
md += [f"| {sp['name']} | {sp['exit_code']} | {sp['device']} | {sp['host_peak_rss_gib']} | {sp['host_peak_pss_tree_gib']} | {sp['gpu_peak_mib']} |" for sp in summary_peers]
md += ["", f"GPU memory used (both peers) peak: {result['gpu_mem_used_peak_mib']} MiB; mean utilisation {result['gpu_util_mean_pct']} %; "
       f"steady GPU tokens/s (both peers) {result['steady_gpu_tokens_per_s']}, MFU {result['steady_gpu_mfu']}", ""]
md += [f"errors: {e}" for e in errors[:20]]
(OUT / "llama_swarm.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
sys.exit(0 if swarm_rounds and not errors else 3)
PY
RC=$?
say "swarm exit $RC; $OUT:"
ls "$OUT"
exit $RC
