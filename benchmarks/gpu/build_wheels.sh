#!/usr/bin/env bash
# Build the wheel folder a lent GPU machine (no network; CPython 3.12 with torch preinstalled)
# needs to run swarmtrain peers: hivemind and the peer's dependencies that its image lacks, and
# what the causal_lm task (peer/task/causal_lm.py) and `swarmtrain data tokenizer|prepare` on
# .py/.txt/.md inputs need (transformers, tokenizers and their runtime requirements).
#   bash benchmarks/gpu/build_wheels.sh            # -> .device/wheels (git-ignored, ~55 MB)
# Then: device run(carry=[".device"], command="bash benchmarks/gpu/llama_run.sh") (or gpu_run.sh).
# Not carried: what the device image already has (torch, numpy, PyYAML, packaging, ...) and HF
# `datasets` with pyarrow/pandas (only .jsonl/.parquet inputs need it; too big for the 64 MiB
# carry). Versions are the ones in this repo's .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.device/wheels
mkdir -p "$OUT"
EXCLUDE="$(git rev-parse --git-path info/exclude)"   # keep .device/ out of git status (and commits)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.device/' "$EXCLUDE" 2>/dev/null || echo '/.device/' >> "$EXCLUDE"
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
BINARY=(hivemind==1.1.12 "grpcio==1.85.1" "grpcio-tools==1.85.1" "protobuf==7.36.2" "cryptography==50.0.2"
        "pydantic==2.14.3" "pydantic-core==2.50.4" "cffi==2.1.1" "blake3==1.0.11" "mmh3==5.3.1")
PURE=(annotated-types==0.8.0 base58==2.1.1 configargparse==1.9.0 morphys==1.0 netaddr==1.3.0 py-cid==0.5.0
      py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 typing-extensions==4.16.0
      typing-inspection==0.4.5)
# causal_lm + `swarmtrain data` (the closure of transformers, tokenizers, huggingface-hub,
# safetensors, regex, tqdm without extras; pydantic/typing-extensions are above; numpy, PyYAML and
# packaging come from the image). idna is tiny and carried anyway: httpx2 needs idna>=3.18, newer
# than an image's copy may be (pip keeps the image's where it is new enough).
LM_BINARY=("tokenizers==0.23.3" "safetensors==0.8.0" "regex==2026.11.15" "hf-xet==1.8.0")
LM_PURE=("transformers==5.23.0" "huggingface-hub==2.4.0" "tqdm==4.70.1" "typer==0.29.2" "click==8.5.1"
         "filelock==4.2.12" "fsspec==2026.9.0" "httpx2==2.16.2" "httpcore2==2.16.2" "anyio==4.16.0" "h11==0.16.0"
         "truststore==0.10.5" "idna==3.20" "rich==15.0.0" "markdown-it-py==4.3.0" "mdurl==0.1.2"
         "pygments==2.21.0" "shellingham==1.5.4" "annotated-doc==0.0.7")
SDIST_ONLY=(varint==1.0.2 python-baseconv==1.2.2 prefetch-generator==1.0.3)
"${PIP[@]}" download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 -d "$OUT" "${BINARY[@]}" "${PURE[@]}" "${LM_BINARY[@]}" "${LM_PURE[@]}"
"${PIP[@]}" wheel --no-deps -w "$OUT" "${SDIST_ONLY[@]}"
ls "$OUT" | wc -l
du -sh "$OUT"
