# A swarmtrain peer on a CUDA GPU (or CPU). Build from the repository root:
#   docker build -f docker/peer.Dockerfile -t swarmtrain-peer .
# Run (keys, checkpoints and data on volumes; the averager needs a large /dev/shm):
#   docker run --gpus all --shm-size=16g -p 31337:31337 -v swarmtrain-keys:/home/swarm/.swarmtrain \
#     -v /data:/data swarmtrain-peer --coordinator HOST:7500 --port 31337
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SWARMTRAIN_HOME=/home/swarm/.swarmtrain

RUN useradd --create-home --uid 10001 swarm
WORKDIR /opt/swarmtrain
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY engine ./engine
COPY peer ./peer
COPY coordinator ./coordinator
COPY swarmtrain ./swarmtrain
# torch with CUDA comes from the base image; pip keeps it (the version range allows it)
RUN pip install --no-cache-dir . && swarmtrain --version

USER 10001
WORKDIR /home/swarm
RUN mkdir -p /home/swarm/.swarmtrain /home/swarm/checkpoints
VOLUME ["/home/swarm/.swarmtrain", "/home/swarm/checkpoints", "/data"]
# the peer's libp2p port (reachable peers accept inbound connections on it)
EXPOSE 31337
ENTRYPOINT ["swarmtrain", "peer"]
CMD ["--help"]
