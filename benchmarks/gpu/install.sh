#!/usr/bin/env bash
# Install swarmtrain's peer-side dependencies on a machine with NO network, from the wheels
# carried in .device/wheels (built by benchmarks/gpu/build_wheels.sh) (CPython 3.12, manylinux x86_64), then check the result.
#
#   bash benchmarks/gpu/install.sh     # from anywhere; uses `python3` (the device's torch venv)
#
# Environment knobs (all optional):
#   PYTHON=/path/to/python3      interpreter to install into (default: python3)
#   WHEELS=/path/to/wheels       wheel folder (default: <repo>/.device/wheels)
#   SWARMTRAIN_ALLOW_CPU=1       do not fail when torch sees no CUDA device (local testing)
#   SWARMTRAIN_SKIP_DHT=1        skip doctor's loopback two-node DHT (p2pd) check
#   SWARMTRAIN_NO_PTH=1          do not write the .pth file that puts the repo on sys.path
#
# Idempotent: a second run installs nothing new (pip finds every requirement satisfied),
# rewrites the same .pth file and repeats the checks. Any failure exits non-zero, loudly.
# torch and the packages already in the device image (numpy, scipy, msgpack, uvloop, PyYAML,
# packaging, idna, sortedcontainers, six, setuptools, ...) are NOT carried: pip uses the
# installed ones. protobuf/grpcio/typing-extensions ARE carried because our generated stubs
# (protocol/coordinator_pb2*.py) need protobuf>=7.35.1,<8 and grpcio>=1.85.1, and pydantic 2.14
# needs typing-extensions>=4.16; pip upgrades the image's copies only where they fall short.
# The same holds for transformers' requirements that an image may hold older copies of (idna,
# filelock, fsspec, click, safetensors, ...: build_wheels.sh carries all of them but numpy,
# PyYAML and packaging).
# The repo itself is not pip-installed: a .pth file (and .device/env.sh, for PYTHONPATH) make
# `import protocol, peer, swarmtrain` and `python3 -m swarmtrain` work.
set -Eeuo pipefail
trap 'echo "install.sh: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

die() { echo "install.sh: ERROR: $*" >&2; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.device/wheels}"

command -v "$PY" >/dev/null || die "no interpreter '$PY' on PATH"
[ -d "$WHEELS" ] || die "wheel folder $WHEELS is missing (carry .device with the run)"
ls "$WHEELS"/hivemind-1.1.12-*.whl >/dev/null 2>&1 || die "no hivemind-1.1.12 wheel in $WHEELS"
[ -f "$ROOT/swarmtrain/__main__.py" ] && [ -d "$ROOT/protocol" ] && [ -d "$ROOT/peer" ] \
    || die "$ROOT does not look like the swarmtrain repo root"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || die "$PY is older than Python 3.11"
"$PY" -m pip --version >/dev/null || die "$PY has no pip"

# The same requirement strings as pyproject.toml, minus torch and numpy (pre-installed, never
# carried), the coordinator-only sqlalchemy/fastapi/uvicorn/prometheus-client/grpcio-health-checking (peers don't import
# them) and HF datasets (only `swarmtrain data prepare` of .jsonl/.parquet inputs imports it; with
# pyarrow and pandas it is too big to carry). transformers/tokenizers: the causal_lm task and
# `swarmtrain data tokenizer|prepare`; safetensors/huggingface-hub/regex come with transformers.
REQS=(
    "hivemind==1.1.12"
    "grpcio>=1.85.1,<2"
    "grpcio-tools>=1.85.1,<2"
    "protobuf>=7.35.1,<8"
    "cryptography>=42"
    "blake3>=1.0,<2"
    "pydantic>=2.6,<3"
    "transformers>=5.0,<6"
    "tokenizers>=0.22,<1"
    "tqdm>=4.66,<5"
)

PIP_FLAGS=(--no-index --find-links "$WHEELS" --no-cache-dir --disable-pip-version-check
           --no-input --progress-bar off)
# A system (non-venv) interpreter marked externally managed (PEP 668) needs this flag.
if "$PY" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if (not in_venv and os.path.exists(marker)) else 1)
EOF
then PIP_FLAGS+=(--break-system-packages); fi

echo "== installing into $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])') from $WHEELS"
# Ignore any pip config/env on the machine (index URLs, constraint files, --user, --target).
env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_NO_INDEX -u PIP_CONSTRAINT \
    -u PIP_REQUIREMENT -u PIP_TARGET -u PIP_PREFIX -u PIP_USER -u PIP_REQUIRE_VIRTUALENV \
    -u PIP_ONLY_BINARY -u PIP_NO_BINARY PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install "${PIP_FLAGS[@]}" "${REQS[@]}"

ENV_SH="$ROOT/.device/env.sh"
cat > "$ENV_SH" <<EOF
# source this: puts the swarmtrain repo ($ROOT) on PYTHONPATH
export PYTHONPATH="$ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
EOF
if [ "${SWARMTRAIN_NO_PTH:-0}" != 1 ]; then
    PURELIB="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$ROOT" > "$PURELIB/swarmtrain-repo.pth" || die "cannot write $PURELIB/swarmtrain-repo.pth"
    echo "== wrote $PURELIB/swarmtrain-repo.pth -> $ROOT"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

echo "== checking installed versions against pyproject.toml"
"$PY" - "$ROOT/pyproject.toml" <<'EOF'
import importlib.metadata as md, sys, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
COORDINATOR_ONLY = {"sqlalchemy", "fastapi", "uvicorn", "prometheus-client", "grpcio-health-checking"}
NOT_CARRIED = {"datasets"}  # .jsonl/.parquet inputs of `swarmtrain data prepare` only
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
bad = []
for spec in deps:
    req = Requirement(spec)
    if req.name.lower() in COORDINATOR_ONLY:
        continue
    if req.name.lower() in NOT_CARRIED:
        print(f"  --  {req.name}: not carried (skipped)")
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(f"{req.name}: not installed (need {req.specifier})")
        continue
    ok = req.specifier.contains(have.split("+")[0], prereleases=True)
    print(f"  {'ok ' if ok else 'BAD'} {req.name} {have} (need {req.specifier or 'any'})")
    if not ok:
        bad.append(f"{req.name} {have} does not satisfy {req.specifier}")
if bad:
    sys.exit("install.sh: ERROR: " + "; ".join(bad))
EOF

echo "== import check"
"$PY" -c "import hivemind, torch; print(hivemind.__version__, torch.__version__, torch.cuda.is_available())"
CUDA="$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')"
if [ "$CUDA" != 1 ] && [ "${SWARMTRAIN_ALLOW_CPU:-0}" != 1 ]; then
    die "torch sees no CUDA device (set SWARMTRAIN_ALLOW_CPU=1 to accept CPU only)"
fi
(cd "$ROOT" && "$PY" - <<EOF
import os, protocol, engine, peer, swarmtrain
from protocol import coordinator_pb2, coordinator_pb2_grpc  # protobuf gencode/runtime check
import hivemind.hivemind_cli as c
p2pd = os.path.join(os.path.dirname(c.__file__), "p2pd")
assert os.access(p2pd, os.X_OK), f"p2pd not executable: {p2pd}"
root = os.path.realpath("$ROOT")
for m in (protocol, engine, peer, swarmtrain):
    assert os.path.realpath(m.__file__).startswith(root + os.sep), f"{m.__name__} imported from {m.__file__}, not {root}"
print("  protocol/engine/peer/swarmtrain from", root, "; stubs import; p2pd at", p2pd)
EOF
)
echo "== causal_lm check (transformers, tokenizers)"
(cd "$ROOT" && HF_HUB_OFFLINE=1 "$PY" - <<'EOF'
import tokenizers, transformers, safetensors.torch
from transformers import AutoConfig, AutoModelForCausalLM
import peer.task.causal_lm, swarmtrain.dataprep  # the task and `swarmtrain data` import cleanly
cfg = AutoConfig.for_model("llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
print(f"  transformers {transformers.__version__}, tokenizers {tokenizers.__version__}: a tiny llama of {n} params builds")
EOF
) || die "transformers/tokenizers check failed"

echo "== python -m swarmtrain --help"
(cd "$ROOT" && "$PY" -m swarmtrain --help >/dev/null) || die "'$PY -m swarmtrain --help' failed"
if [ "${SWARMTRAIN_NO_PTH:-0}" != 1 ]; then   # the .pth alone (no PYTHONPATH, other cwd) must do
    (cd / && env -u PYTHONPATH "$PY" -m swarmtrain --help >/dev/null) \
        || die "'$PY -m swarmtrain --help' fails outside the repo without PYTHONPATH"
fi

echo "== swarmtrain doctor"
DOCTOR_ARGS=(--key "$(mktemp -u /tmp/swarmtrain-doctor-key.XXXXXX)")
[ "${SWARMTRAIN_SKIP_DHT:-0}" = 1 ] && DOCTOR_ARGS+=(--skip-network)
(cd "$ROOT" && "$PY" -m swarmtrain doctor "${DOCTOR_ARGS[@]}") || die "swarmtrain doctor failed"

echo "== install.sh: OK (for a new shell without the .pth: source $ENV_SH)"
