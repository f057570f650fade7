# swarmtrain: `make demo` and `make test` each build .venv on a fresh machine first.
# The second run only re-installs when pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
# Without CUDA, torch is installed explicitly first (the CPU build) so that resolving the
# project's `torch` requirement does not pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: all venv web lint images test-images test-slow bench-scale bench-rounds bench-quality bench-join bench-churn bench-relay-loss bench-soak test test-unit test-integration test-e2e demo bench proto clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "installing $(TORCH_CPU) (CPU build)"; $(PIP) install "$(TORCH_CPU)"; fi
	$(PIP) install -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP) web

# The dashboard's charting library (uPlot, pinned with its digest in web/package-lock.json),
# installed with npm (Debian's package where it is missing) and copied into the package, which
# serves it itself: no CDN. pip installs it as package data from there.
WEB_VENDOR := coordinator/http/static/vendor
WEB_ASSETS := $(WEB_VENDOR)/uPlot.iife.min.js $(WEB_VENDOR)/uPlot.min.css $(WEB_VENDOR)/uPlot.LICENSE
web: $(WEB_ASSETS)
$(WEB_ASSETS): web/package.json web/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "installing npm (Debian's package)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null; }
	cd web && npm ci --no-audit --no-fund --loglevel=error
	mkdir -p $(WEB_VENDOR)
	cp web/node_modules/uplot/dist/uPlot.iife.min.js web/node_modules/uplot/dist/uPlot.min.css $(WEB_VENDOR)/
	cp web/node_modules/uplot/LICENSE $(WEB_VENDOR)/uPlot.LICENSE

# The suite runs against SQLite and, where PostgreSQL can be started here (root installs
# Debian's package), against a throwaway PostgreSQL server too.
PG_DIR := $(CURDIR)/.pgtest
PG_PORT ?= auto

# The layering rule (import-linter contracts in pyproject.toml), lint + format (ruff) and types
# (mypy) of the product packages; `make test` runs it first and fails on any violation.
LINTED := protocol engine relay peer coordinator swarmtrain benchmarks tests
lint: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

BESIDE_LOG ?= /tmp/swarmtrain-beside-swarms-$$$$.log
BESIDE_JUNIT ?=
test: $(STAMP) web lint
	@.ci/chromium.sh || echo "the dashboard's browser test will be skipped"
	@.ci/nftables.sh || echo "the NAT lab's tests will be skipped"
	@url=$$(.ci/postgres.sh start $(PG_DIR) $(PG_PORT) 2>/tmp/swarmtrain-pg.err) \
		|| { echo "PostgreSQL unavailable: $$(cat /tmp/swarmtrain-pg.err); its tests are skipped"; url=""; }; \
	export SWARMTRAIN_TEST_POSTGRES_URL=$$url; \
	$(PY) -m pytest -q -m beside_swarms --durations=10 $(BESIDE_JUNIT:%=--junitxml=%) tests > $(BESIDE_LOG) 2>&1 & beside=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not beside_swarms" --durations=20 tests; code=$$?; \
	wait $$beside; beside_code=$$?; \
	echo "--- the unit and light integration tests, run beside the swarms (tests/conftest.py):"; cat $(BESIDE_LOG); rm -f $(BESIDE_LOG); \
	.ci/postgres.sh stop $(PG_DIR); [ $$code -ne 0 ] && exit $$code; exit $$beside_code

# The suite as a slower or shared machine runs it: `make test` with a busy loop on one core
# beside it (LOAD=2: both cores); CPUS=1.33 also caps the suite and the loops at 1.33 CPUs in
# all (a CPU cgroup; root), a machine 1.5x slower. Run it before resolving an issue that adds
# swarm tests: a test that passes only on an idle machine fails on a volunteer's or a CI's.
LOAD ?= 1
CPUS ?=
test-slow: $(STAMP)
	.ci/under-load.sh $(if $(CPUS),--cpus $(CPUS)) $(LOAD) $(MAKE) test

# The peer and coordinator images (docker/images.sh): with docker where an engine runs, else
# with buildah from a local Debian 12 stand-in base. IMAGES_BASE=real|standin, IMAGES_TAG=...
images: $(STAMP) web
	PY=$(PY) bash docker/images.sh

# Builds both images from the stand-in base and runs a swarm from them
# (tests/images/test_images.py; minutes of builds, so a step of its own that .ci/run runs after
# `make test`; needs root: buildah, network namespaces).
test-images: $(STAMP)
	SWARMTRAIN_TEST_IMAGES=1 $(PY) -m pytest -q -p no:cacheprovider tests/images

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

test-e2e: $(STAMP) web
	$(PY) -m pytest -q tests/e2e

# A local coordinator (SQLite, dashboard) and 3 CPU peers train the embedded demo spec, then
# a summary with each peer's verified credit.
demo: $(STAMP) web
	$(VENV)/bin/swarmtrain demo

# The WAN benchmark (issue #5; not part of `make test`): needs root for network namespaces.
# Results (Markdown, JSON, PNG plots) go to benchmarks/results/. BENCH_ARGS="--peers 4 --link 20mbit"
bench: $(STAMP)
	$(PIP) install -e ".[bench]"
	$(PY) -m benchmarks.wan $(BENCH_ARGS)

# The peer's host cost as the model grows (issue #12; not part of `make test`): 2 peers on
# loopback per size, this code against a baseline git ref. SCALE_ARGS="--sizes 10M,50M,200M"
# Then averaging throughput against the part size (benchmarks/allreduce_parts.py, PARTS_ARGS).
bench-scale: $(STAMP)
	$(PIP) install -e ".[bench]"
	$(PY) -m benchmarks.scale $(SCALE_ARGS)
	$(PY) -m benchmarks.allreduce_parts $(PARTS_ARGS)

# Round formation and averaging against the swarm's size (issue #25; not part of `make test`):
# N swarm members on loopback per size. ROUNDS_ARGS="--sizes 16,64,128 --rounds 8"
bench-rounds: $(STAMP)
	$(PY) -m benchmarks.round_formation $(ROUNDS_ARGS)

# Training quality (issue #34; not part of `make test`): the swarm against one peer and
# synchronous data parallel, in process and (--swarm) as real local swarms.
# QUALITY_ARGS="--suite headline,outer,hk,codec,overlap,robust --seeds 0,1,2 --rounds 30 --swarm"
bench-quality: $(STAMP)
	$(PIP) install -e ".[bench]"
	$(PY) -m benchmarks.training_quality $(QUALITY_ARGS)

# A volunteer on a link 10x slower than the swarm's joins it (issue #49; not part of `make test`;
# needs root for network namespaces): with members keeping updates, then keeping none.
# JOIN_ARGS="--slow 350kbit --fast 3500kbit --codec sparse"
bench-join: $(STAMP)
	$(PY) -m benchmarks.slow_join $(JOIN_ARGS)

bench-churn: $(STAMP)
	$(PY) -m benchmarks.churn $(CHURN_ARGS)

# NAT'ed peers whose two relays die, then a new volunteer's relay (issue #49; root: namespaces,
# nftables): the rounds until they average again. RELAY_LOSS_ARGS="--runs 3"
bench-relay-loss: $(STAMP)
	$(PY) -m benchmarks.relay_loss $(RELAY_LOSS_ARGS)

# Injected failures at scale: 1,200 kills, leaves, joins, relay deaths and coordinator SIGKILLs
# on SQLite then PostgreSQL (issue #49; root: namespaces, nftables NAT; about an hour here).
# SOAK_ARGS="--failures 1200 --every-s 1 --minutes 56" is the run the README quotes
bench-soak: $(STAMP)
	$(PY) -m benchmarks.soak $(SOAK_ARGS)

# Regenerate the committed gRPC stubs after editing protocol/*.proto
# (tests/unit/test_proto_stubs.py fails while they are stale).
proto: $(STAMP)
	$(PY) -m protocol.protogen

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
