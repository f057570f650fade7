# A swarmtrain peer on a CUDA GPU (or CPU). Build from the repository root with `make images`
# (it makes build/wheelhouse first: the project and its pinned dependencies, as wheels), or:
#   docker build -f docker/peer.Dockerfile -t swarmtrain-peer .
# Run (keys, checkpoints and data on volumes; the averager needs a large /dev/shm):
#   docker run --gpus all --shm-size=16g -p 31337:31337 -v swarmtrain-keys:/home/swarm/.swarmtrain \
#     -v /data:/data swarmtrain-peer --coordinator HOST:7500 --port 31337
# BASE: any image with Python 3.11 and torch on its PATH's pip (torch comes from the base: the
# CUDA build there; the wheelhouse's own torch, a CPU build, is left out here).
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

FROM scratch AS wheels
COPY build/wheelhouse/ /

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SWARMTRAIN_HOME=/home/swarm/.swarmtrain
RUN useradd --create-home --uid 10001 swarm
# the wheelhouse is mounted for this step only: none of it stays in a layer. WHEELHOUSE names its
# contents (docker/images.sh: a digest of the wheels' RECORDs), so that a layer cache keyed on
# the step's text and arguments (buildah's ignores mounted content) rebuilds when they change
ARG WHEELHOUSE=unnamed
RUN --mount=type=bind,from=wheels,target=/wheels \
    echo "wheelhouse ${WHEELHOUSE}" \
    && grep -v '^torch==' /wheels/requirements.lock > /tmp/pins.txt \
    && pip install --no-cache-dir --no-index --find-links /wheels -c /tmp/pins.txt swarmtrain \
    && rm /tmp/pins.txt \
    && swarmtrain --version

USER 10001
WORKDIR /home/swarm
RUN mkdir -p /home/swarm/.swarmtrain /home/swarm/checkpoints
VOLUME ["/home/swarm/.swarmtrain", "/home/swarm/checkpoints", "/data"]
# the peer's libp2p port (reachable peers accept inbound connections on it)
EXPOSE 31337
ENTRYPOINT ["swarmtrain", "peer"]
CMD ["--help"]
