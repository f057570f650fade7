# A swarmtrain coordinator (no GPU, no torch at run time beyond the package's dependency).
# Build from the repository root:
#   docker build -f docker/coordinator.Dockerfile -t swarmtrain-coordinator .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

# the PostgreSQL client, for an operator's psql/pg_dump against the run's database
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-client=15* curl=7.* \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 swarm
WORKDIR /opt/swarmtrain
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY engine ./engine
COPY peer ./peer
COPY coordinator ./coordinator
COPY swarmtrain ./swarmtrain
# the project itself (its dependencies' versions are bounded in pyproject.toml)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu ".[postgres]" \
    && swarmtrain --version

USER 10001
WORKDIR /home/swarm
RUN mkdir -p /home/swarm/state
VOLUME ["/home/swarm/state"]
# gRPC API, DHT bootstrap, dashboard + JSON API + /metrics
EXPOSE 7500 7600 8080 7800-7864
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["swarmtrain", "coordinator"]
CMD ["--help"]
