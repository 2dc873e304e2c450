#!/usr/bin/env bash
# `make sanitize`: build the engine and the binding modules with AddressSanitizer + UndefinedBehaviorSanitizer in
# build/sanitize (plain CMake, its own tree: the release build in build/<wheel_tag> is untouched), then run the unit,
# parity and fuzz suites against those modules. Any finding aborts the process, so the run fails.
#
# The extension is instrumented, CPython and torch are not: the ASan runtime must be the first library loaded
# (LD_PRELOAD=libasan.so, with libstdc++), and leak detection is off (CPython and torch keep allocations until exit on purpose; a
# leak report there is not ours). UBSan: every check except vptr, none recoverable (-fno-sanitize-recover=all).
# vptr is off because pybind11 modules are built with -fvisibility=hidden, so type_info objects are not merged across
# the modules, torch and the engine, and the vptr check reports those as false mismatches.
set -euo pipefail
PY=${PY:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, symlink kept: a venv's python is a symlink
DIR=${SANITIZE_DIR:-build/sanitize}
TESTS=${SANITIZE_TESTS:-tests/test_geometry.py tests/test_kv_state.py tests/test_admission.py tests/test_transfer.py
  tests/test_attention.py tests/test_selection.py tests/test_cpu_kernel.py tests/test_telemetry.py
  tests/test_backend.py tests/test_boundary_faults.py tests/test_concurrency.py tests/test_fuzz_bindings.py
  tests/test_parity.py}
FLAGS="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=all -fno-omit-frame-pointer"
MODULES="geometry kv_state admission transfer attention telemetry backend"

start=$(date +%s)
cmake -S . -B "$DIR" -G Ninja -DCMAKE_MAKE_PROGRAM="$(dirname "$PY")/ninja" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$PY" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
  > "$DIR.cmake.log" 2>&1 || { cat "$DIR.cmake.log"; exit 1; }
targets=""
for m in $MODULES; do targets="$targets _$m"; done
cmake --build "$DIR" --target activekv_engine $targets -- -j"${SANITIZE_JOBS:-2}"
built=$(date +%s)

# The modules as the package `activekv` (a namespace package): a folder on PYTHONPATH ahead of site-packages.
rm -rf "$DIR/pkg" && mkdir -p "$DIR/pkg/activekv"
for m in $MODULES; do ln -s "$(realpath "$DIR"/_"$m".*.so)" "$DIR/pkg/activekv/"; done
# The series beside the modules, where the wheel installs it: _backend's start-up check reads it there in a process
# that imported vLLM.
ln -s "$(realpath patches)" "$DIR/pkg/activekv/patches"

# libstdc++ is preloaded too: python does not link it, so without it ASan's __cxa_throw interceptor finds no real
# __cxa_throw at start-up and the first C++ exception (any rejected input) aborts with "CHECK failed ... real___cxa_throw".
export LD_PRELOAD="$(realpath "$(g++ -print-file-name=libasan.so)") $(realpath "$(g++ -print-file-name=libstdc++.so)")"
# allocator_may_return_null=1: an impossible pool (tests ask for 10^12 blocks) must fail in malloc as it does without
# ASan, so torch raises and the engine names pool_blocks; ASan's default aborts on any allocation over its limit.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1:strict_init_order=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$(realpath "$DIR/pkg")${PYTHONPATH:+:$PYTHONPATH}"
# Refuse to report a pass for modules that were not the instrumented ones.
"$PY" -c "
import sys, torch, importlib
for m in '$MODULES'.split():
    f = importlib.import_module('activekv._' + m).__file__
    assert f.startswith(sys.argv[1]), ('not the sanitized module', f)
print('sanitized modules from', sys.argv[1])" "$(realpath "$DIR/pkg")"
# shellcheck disable=SC2086
"$PY" -m pytest -q -p no:cacheprovider $TESTS ${PYTEST_ARGS:-}
end=$(date +%s)
echo "make sanitize: build $((built - start)) s, tests $((end - built)) s, no sanitizer finding"
