#!/usr/bin/env bash
# Build the wheel folder a lent GPU machine (no network; CPython 3.12 with torch preinstalled)
# needs to run swarmtrain peers: hivemind and the peer's dependencies that its image lacks.
#   bash benchmarks/gpu/build_wheels.sh            # -> .device/wheels (git-ignored, ~30 MB)
# Then: device run(carry=[".device"], command="bash benchmarks/gpu/gpu_run.sh").
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.device/wheels
mkdir -p "$OUT"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
BINARY=(hivemind==1.1.12 "grpcio==1.85.1" "grpcio-tools==1.85.1" "protobuf==7.36.2" "cryptography==50.0.2"
        "pydantic==2.14.3" "pydantic-core==2.50.4" "cffi==2.1.1" "blake3==1.0.11" "mmh3==5.3.1")
PURE=(annotated-types==0.8.0 base58==2.1.1 configargparse==1.9.0 morphys==1.0 netaddr==1.3.0 py-cid==0.5.0
      py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 typing-extensions==4.16.0
      typing-inspection==0.4.5)
SDIST_ONLY=(varint==1.0.2 python-baseconv==1.2.2 prefetch-generator==1.0.3)
"${PIP[@]}" download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 -d "$OUT" "${BINARY[@]}" "${PURE[@]}"
"${PIP[@]}" wheel --no-deps -w "$OUT" "${SDIST_ONLY[@]}"
ls "$OUT" | wc -l
du -sh "$OUT"
