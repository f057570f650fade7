# A swarmtrain coordinator (no GPU; torch only as the package's dependency, a CPU build). Build
# from the repository root with `make images` (it makes build/wheelhouse first), or:
#   docker build -f docker/coordinator.Dockerfile -t swarmtrain-coordinator .
# BASE: any Debian 12 image with Python 3.11 and pip on its PATH.
ARG BASE=python:3.11-slim

FROM scratch AS wheels
COPY build/wheelhouse/ /

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1
# the PostgreSQL client, for an operator's psql/pg_dump against the run's database
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-client=15* curl=7.* \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 swarm
# the wheelhouse is mounted for this step only: none of it stays in a layer. WHEELHOUSE names its
# contents (docker/images.sh: a digest of the wheels' RECORDs), so that a layer cache keyed on
# the step's text and arguments (buildah's ignores mounted content) rebuilds when they change
ARG WHEELHOUSE=unnamed
RUN --mount=type=bind,from=wheels,target=/wheels \
    echo "wheelhouse ${WHEELHOUSE}" \
    && pip install --no-cache-dir --no-index --find-links /wheels -c /wheels/requirements.lock "swarmtrain[postgres]" \
    && swarmtrain --version

USER 10001
WORKDIR /home/swarm
RUN mkdir -p /home/swarm/state
VOLUME ["/home/swarm/state"]
# gRPC API, DHT bootstrap, dashboard + JSON API + /metrics, the relay's ports
EXPOSE 7500 7600 8080 7800-7864
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["swarmtrain", "coordinator"]
CMD ["--help"]
