#!/usr/bin/env bash
# issue #52: a coordinator under 10,000 simulated peers on a lent device machine's 16 cores
# (benchmarks/coordinator_load.py; on the 2-core VM the load process, the coordinator and its
# heartbeat process share two cores). Prepared here:
#   bash benchmarks/gpu/build_coordinator_wheels.sh                 # .device/coordinator-wheels
#   mkdir -p .device/base && git archive 2c044ed | tar -x -C .device/base   # the baseline's source
# then run(carry=[".device"], command="bash benchmarks/gpu/coordinator_run.sh", timeout_s=560).
# Writes to $OUT: coordinator-load-<date>-device-sqlite.{md,json}, coordinator_load.log, machine.txt.
# Knobs: PEERS (10000), DURATION (60), PROCESSES ("4 1"), REF (2c044ed; "" for none), SETTLE_S (20), LABEL.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
OUT="${OUT:-/tmp/coordinator-run}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .device/coordinator-wheels/*.whl > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
chmod +x /tmp/site/hivemind/hivemind_cli/p2pd 2>/dev/null
export PYTHONPATH="/tmp/site:$ROOT" PYTHONUNBUFFERED=1
{ nproc; free -g; python3 --version; uname -r; } > "$OUT/machine.txt" 2>&1
python3 -c "import hivemind, sqlalchemy, fastapi, uvicorn, grpc, grpc_health, google.protobuf as p; \
print('hivemind', hivemind.__version__, 'sqlalchemy', sqlalchemy.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)" \
    || exit 1
python3 -m swarmtrain coordinator --help > /dev/null || exit 1
REF="${REF-2c044ed}"
REF_ARGS=()
[ -n "$REF" ] && REF_ARGS=(--ref "$REF" --ref-tree .device/base)
# shellcheck disable=SC2086
python3 -m benchmarks.coordinator_load --peers ${PEERS:-10000} --duration "${DURATION:-60}" --db sqlite \
    --heartbeat-processes ${PROCESSES:-4 1} "${REF_ARGS[@]}" --settle-s "${SETTLE_S:-20}" \
    --label "${LABEL:-device-sqlite}" --out "$OUT" 2>&1 | tee "$OUT/coordinator_load.log"
