# weightsync: `make demo` runs the local demo, `make test` runs every CPU test tier,
# `make images REGISTRY=registry.example.com/team TAG=0.1.0` publishes the images.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo demo-down setup images test lint test-unit test-cluster test-e2e test-gpu bench crds verify-crds \
        cluster-up cluster-down chaos chaos-restarts scale test-engine-pods

demo:  ## the local demo: control plane, chart, trainer + engines syncing, a crash recovered
	@# reference engines only (not vLLM's and SGLang's venvs); setup's step times for the summary
	times=$$(mktemp) && WEIGHTSYNC_SETUP_ENGINES=0 WEIGHTSYNC_SETUP_TIMES=$$times bash .ci/setup \
	  && $(PY) -m tests.e2e.demo run --setup-times $$times $(DEMO_ARGS); rc=$$?; rm -f $$times; exit $$rc

demo-down:  ## stop everything `make demo` started
	$(PY) -m tests.e2e.demo down

setup:  ## install Debian packages, the venv and the control plane's binaries
	bash .ci/setup

# `make images`' settings, each passed only when set (docs/install.md#images).
IMAGES_FLAGS = $(if $(REGISTRY),--registry '$(REGISTRY)') $(if $(TAG),--tag '$(TAG)') \
  $(if $(PYTHON_IMAGE),--build-arg 'PYTHON_IMAGE=$(PYTHON_IMAGE)') \
  $(if $(CUDA_IMAGE),--build-arg 'CUDA_IMAGE=$(CUDA_IMAGE)') $(IMAGES_ARGS)

images:  ## build every image with buildah; with REGISTRY=<registry>/<path> push them
	python3 -m images.build $(strip $(IMAGES_FLAGS))

lint: setup  ## ruff, mypy --strict, import boundaries, CRD drift
	$(VENV)/bin/ruff check operator tests images
	$(VENV)/bin/ruff format --check operator tests images
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(MAKE) --no-print-directory verify-crds

test: lint  ## everything CI runs: lint, unit, integration, cluster and e2e tiers
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-cluster: setup
	$(PY) -m pytest -m cluster $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

chaos: setup  ## the fault matrix (100 faults; CI runs 10), the recovery scenarios (10 kills each; CI 4), then chaos-restarts
	CHAOS_FAULTS=$${CHAOS_FAULTS:-100} RECOVERY_KILLS=$${RECOVERY_KILLS:-10} \
	$(PY) -m pytest -m e2e tests/e2e/test_chaos.py tests/e2e/test_recovery.py -s $(PYTEST_ARGS)
	$(MAKE) chaos-restarts

chaos-restarts: setup  ## engines restarted in place 200 times under CPU contention: 0 stale Ready
	CHAOS_KINDS=engine_restart CHAOS_FAULTS=$${CHAOS_RESTARTS:-200} CHAOS_LOAD=$${CHAOS_LOAD:-2} \
	$(PY) -m pytest -m e2e tests/e2e/test_chaos.py -s $(PYTEST_ARGS)

test-engine-pods: setup  ## real vLLM and SGLang engine pods on the real node: synced, killed, recovered
	$(PY) -m pytest tests/e2e/test_real_engines.py $(PYTEST_ARGS)

scale: setup  ## one WeightSync grown to 1,000 KWOK pods (agents: a load generator); prints a table
	$(PY) -m tests.scale run $(SCALE_ARGS)

test-gpu:  ## on a GPU machine: the same contracts over NCCL
	NCCL_NVLS_ENABLE=0 python3 -m pytest -m "gpu or multigpu" -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

bench:  ## on a machine with 2-4 GPUs: round vs raw NCCL floor (see docs/benchmarks.md)
	NCCL_NVLS_ENABLE=0 python3 -m tests.bench.bench_broadcast

crds:  ## regenerate crds/ and the chart's copy from the pydantic models
	$(PY) -m weightsync.api.crd

verify-crds:
	$(PY) -m weightsync.api.crd --check

cluster-up: setup  ## a local control plane for poking at by hand
	$(PY) -m tests.cluster.controlplane up --nodes 0 --real-node --images

cluster-down:
	$(PY) -m tests.cluster.controlplane down
