#!/usr/bin/env bash
# `make images`: the peer and coordinator images, with docker where an engine runs, else with
# buildah (Debian's package; installed here when missing and this is root with apt-get).
#
#   IMAGES_BASE=auto|real|standin  the bases: `real` is the Dockerfiles' own (pytorch/pytorch,
#                                  python:3.11-slim: a registry must be reachable); `standin` is a
#                                  local Debian 12 root made with debootstrap, Python 3.11 and
#                                  CPU torch (docker/standin-base.Dockerfile); `auto`: real with
#                                  docker, standin with buildah
#   IMAGES_TAG=latest              tag of swarmtrain-peer and swarmtrain-coordinator
#
# Both images install the project from build/wheelhouse, made here first by this machine's pip:
# the project's wheel and every dependency pinned to the versions of the tested .venv
# (requirements.lock beside them), so that a build needs no index and no network of its own.
# Prints each image's size and build time; writes them to build/images.json.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
WHEELHOUSE=build/wheelhouse
ROOTFS=build/bookworm-root
ROOT_IMAGE=localhost/swarmtrain-bookworm-root
STANDIN_IMAGE=localhost/swarmtrain-standin-base
TAG=${IMAGES_TAG:-latest}
MODE=${IMAGES_BASE:-auto}

say() { echo "images: $*"; }
die() { echo "images: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.0f}')" "$1" "$(now)"; }

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=docker
else
    if ! command -v buildah >/dev/null 2>&1; then
        [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
            || die "neither a docker engine nor buildah here (buildah: Debian's package, needs root to install)"
        say "installing buildah"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
    fi
    ENGINE=buildah
fi
case "$MODE" in
    auto) [ "$ENGINE" = docker ] && MODE=real || MODE=standin ;;
    real | standin) ;;
    *) die "IMAGES_BASE must be auto, real or standin, not '$MODE'" ;;
esac
say "engine $ENGINE, bases: $MODE"

# The build writes ~5 GB (the wheelhouse, a stand-in base, two images of ~2 GB each): with less
# free, buildah fails midway with "io: read/write on closed pipe", which names nothing.
NEED_GB=${IMAGES_NEED_GB:-6}
if [ "$ENGINE" = docker ]; then
    STORE=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
    PRUNE="docker image prune"
else
    PRUNE="buildah rmi --prune"
    STORE=$(buildah info --format '{{.store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)
fi
for where in "$STORE" build; do
    mkdir -p "$where" 2>/dev/null || true
    free_gb=$(df -P -BG "$where" 2>/dev/null | awk 'NR == 2 {sub("G", "", $4); print $4}')
    [ -z "$free_gb" ] || [ "$free_gb" -ge "$NEED_GB" ] \
        || die "${free_gb} GB free under $where; the build needs ${NEED_GB} GB: free some ('$PRUNE' removes untagged images)"
done

build() {  # build IMAGE DOCKERFILE [--build-arg ...]
    local image=$1 file=$2
    shift 2
    if [ "$ENGINE" = docker ]; then
        DOCKER_BUILDKIT=1 docker build -q -f "$file" -t "$image" "$@" . >/dev/null
    else
        # docker's format: OCI's has no HEALTHCHECK
        buildah bud --isolation chroot --format docker --layers -q -f "$file" -t "$image" "$@" . >/dev/null
    fi
}

size_of() {
    if [ "$ENGINE" = docker ]; then
        docker image inspect --format '{{.Size}}' "$1"
    else
        buildah inspect --type image --format '{{.Manifest}}' "$1" \
            | "$PY" -c "import json, sys; print(sum(layer['size'] for layer in json.load(sys.stdin)['layers']))"
    fi
}

# a rebuild removes the image it replaces (else each leaves ~2 GB of untagged image behind)
image_id() {
    if [ "$ENGINE" = docker ]; then
        docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true
    else
        buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true
    fi
}
# untagged images: a multi-stage build leaves its `wheels` stage behind as one (~0.5 GB, new with
# every wheelhouse); the build removes those it made, and leaves any that were here before it
dangling() {
    if [ "$ENGINE" = docker ]; then
        docker images -q --no-trunc --filter dangling=true 2>/dev/null | sort -u || true
    else
        buildah images -q --no-trunc --filter dangling=true 2>/dev/null | sort -u || true
    fi
}
remove_image() {
    if [ "$ENGINE" = docker ]; then
        docker image rm "$1" >/dev/null 2>&1 || true
    else
        buildah rmi "$1" >/dev/null 2>&1 || true
    fi
}
replace() {  # replace IMAGE DOCKERFILE [--build-arg ...]
    local before after untagged_before made
    before=$(image_id "$1")
    untagged_before=$(dangling)
    build "$@"
    after=$(image_id "$1")
    if [ -n "$before" ] && [ "$before" != "$after" ]; then
        remove_image "$before"
    fi
    made=$(comm -13 <(echo "$untagged_before") <(dangling))
    for image in $made; do
        remove_image "$image"
    done
}

# 1. the wheelhouse: the project and its dependencies at the tested versions
started=$(now)
rm -rf "$WHEELHOUSE" build/pins.txt
mkdir -p "$WHEELHOUSE"
"$PY" -m pip freeze --exclude-editable > build/pins.txt
"$PY" -m pip wheel -q --disable-pip-version-check --wheel-dir "$WHEELHOUSE" -c build/pins.txt ".[postgres]" 2>&1 \
    | grep -v "^WARNING: Location" || true
"$PY" - "$WHEELHOUSE" <<'PYEOF'
import sys
from pathlib import Path

# name==version of every wheel: what the images install, and nothing else
house = Path(sys.argv[1])
pins = sorted("{}=={}".format(*w.name.split("-")[:2]) for w in house.glob("*.whl"))
if not any(p.startswith("swarmtrain==") for p in pins):
    sys.exit("images: the wheelhouse has no swarmtrain wheel")
(house / "requirements.lock").write_text("\n".join(pins) + "\n")
PYEOF
wheels_s=$(since "$started")
# what the wheelhouse holds, by content: each wheel's RECORD lists the digest of every file in
# it (a wheel's own bytes carry the source files' timestamps, which differ between clones)
WHEELHOUSE_ID=$("$PY" - "$WHEELHOUSE" <<'PYEOF'
import hashlib
import sys
import zipfile
from pathlib import Path

digest = hashlib.sha256()
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        record = next(name for name in archive.namelist() if name.endswith(".dist-info/RECORD"))
        digest.update(wheel.name.encode() + b"\0" + archive.read(record))
print(digest.hexdigest()[:16])
PYEOF
)
TORCH_PINS=$(grep -E '^(torch|numpy)==' "$WHEELHOUSE/requirements.lock" | tr '\n' ' ')
say "wheelhouse $WHEELHOUSE_ID: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), ${wheels_s} s"

# 2. the bases
PEER_ARGS=(--build-arg "WHEELHOUSE=$WHEELHOUSE_ID")
COORD_ARGS=(--build-arg "WHEELHOUSE=$WHEELHOUSE_ID")
base_s=0
if [ "$MODE" = standin ]; then
    started=$(now)
    if ! buildah inspect --type image "$ROOT_IMAGE" >/dev/null 2>&1; then
        if ! command -v debootstrap >/dev/null 2>&1; then
            [ "$(id -u)" = 0 ] || die "debootstrap is missing (Debian's package; needs root)"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
        fi
        say "debootstrap: Debian 12 (bookworm) into $ROOTFS"
        rm -rf "$ROOTFS"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$ROOTFS" http://deb.debian.org/debian >build/debootstrap.log 2>&1 \
            || die "debootstrap failed: see build/debootstrap.log"
        container=$(buildah from scratch)
        mount=$(buildah mount "$container")
        tar -C "$ROOTFS" -c . | tar -C "$mount" -x
        buildah umount "$container" >/dev/null
        buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
        buildah commit -q "$container" "$ROOT_IMAGE" >/dev/null
        buildah rm "$container" >/dev/null
        rm -rf "$ROOTFS"
    fi
    replace "$STANDIN_IMAGE" docker/standin-base.Dockerfile --build-arg "ROOT=$ROOT_IMAGE" \
        --build-arg "TORCH_PINS=$TORCH_PINS"
    base_s=$(since "$started")
    say "stand-in base $STANDIN_IMAGE: ${base_s} s"
    PEER_ARGS+=(--build-arg "BASE=$STANDIN_IMAGE")
    COORD_ARGS+=(--build-arg "BASE=$STANDIN_IMAGE")
fi

# 3. the images
started=$(now)
replace "swarmtrain-peer:$TAG" docker/peer.Dockerfile "${PEER_ARGS[@]}"
peer_s=$(since "$started")
started=$(now)
replace "swarmtrain-coordinator:$TAG" docker/coordinator.Dockerfile "${COORD_ARGS[@]}"
coordinator_s=$(since "$started")
peer_size=$(size_of "swarmtrain-peer:$TAG")
coordinator_size=$(size_of "swarmtrain-coordinator:$TAG")
say "swarmtrain-peer:$TAG ${peer_size} bytes, ${peer_s} s; swarmtrain-coordinator:$TAG ${coordinator_size} bytes, ${coordinator_s} s"
cat >build/images.json <<JSON
{"engine": "$ENGINE", "bases": "$MODE", "tag": "$TAG", "wheelhouse_s": $wheels_s, "base_s": $base_s,
 "peer": {"bytes": $peer_size, "build_s": $peer_s}, "coordinator": {"bytes": $coordinator_size, "build_s": $coordinator_s}}
JSON
