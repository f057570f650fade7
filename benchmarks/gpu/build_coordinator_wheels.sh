#!/usr/bin/env bash
# Build the wheel folder a lent device machine (no network; CPython 3.12 with torch and many
# packages preinstalled) needs to run a swarmtrain coordinator and benchmarks/coordinator_load.py:
# hivemind and the coordinator's own dependencies (SQLAlchemy, FastAPI, uvicorn, gRPC health).
#   bash benchmarks/gpu/build_coordinator_wheels.sh     # -> .device/coordinator-wheels (git-ignored, ~35 MB)
# Then: device run(carry=[".device"], command="bash benchmarks/gpu/coordinator_run.sh").
# Versions are the ones in this repo's .venv; what the image already has in a version that will
# do (numpy, msgpack, uvloop, sortedcontainers, PyYAML, scipy, packaging) is not carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.device/coordinator-wheels
mkdir -p "$OUT"
EXCLUDE="$(git rev-parse --git-path info/exclude)"   # keep .device/ out of git status (and commits)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.device/' "$EXCLUDE" 2>/dev/null || echo '/.device/' >> "$EXCLUDE"
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pinned() { for name in "$@"; do echo "$name==$(version "$name")"; done; }
BINARY=(hivemind grpcio grpcio-tools protobuf cryptography pydantic pydantic-core cffi blake3 mmh3 sqlalchemy greenlet)
PURE=(annotated-types base58 configargparse netaddr py-cid py-multibase py-multicodec py-multihash morphys
      pycparser typing-extensions typing-inspection fastapi starlette uvicorn anyio h11 click idna annotated-doc
      opentelemetry-api prometheus-client grpcio-health-checking)
SDIST_ONLY=(varint python-baseconv prefetch-generator)
"${PIP[@]}" download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 -d "$OUT" $(pinned "${BINARY[@]}" "${PURE[@]}")
"${PIP[@]}" wheel --no-deps -w "$OUT" $(pinned "${SDIST_ONLY[@]}")
ls "$OUT" | wc -l
du -sh "$OUT"
