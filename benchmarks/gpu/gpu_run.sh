#!/bin/bash
# Two GPU peers of a ~1B byte-GPT on one H100 (issue #12's GPU check), with the current code.
set -uo pipefail
cd "$(dirname "$0")/../.."
SWARMTRAIN_SKIP_DHT=1 bash benchmarks/gpu/install.sh > $OUT/install.log 2>&1 || { tail -30 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
free -g | tee -a $OUT/gpu.txt
( while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $OUT/gpu_util.csv; sleep 1; done ) &
MON=$!
timeout 540 python3 - <<'PY' 2>&1 | tail -40
import json, os, time
from pathlib import Path
from benchmarks.scale import run_pair, summarize, REPO
t = time.time()
r = run_pair(REPO, "1B", Path("/tmp/gpu1b"), 2)
s = summarize("1B", r, "current")
out = {"summary": s, "rows": r["rows"], "seconds": time.time() - t}
Path(os.environ["OUT"], "gpu1b.json").write_text(json.dumps(out, indent=1))
print(json.dumps(s))
for i, rows in enumerate(r["rows"]):
    for row in rows:
        print(i, {k: row.get(k) for k in ("round", "averaged", "group_size", "compute_s", "wait_s", "wall_s", "host_s", "allreduce_s", "bytes_sent")})
PY
kill $MON
cp /tmp/gpu1b/peer0.log $OUT/peer0.log 2>/dev/null; cp /tmp/gpu1b/peer1.log $OUT/peer1.log 2>/dev/null
tail -5 /tmp/gpu1b/peer0.log
