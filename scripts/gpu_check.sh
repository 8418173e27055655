#!/usr/bin/env bash
# The one call on the lent GPU machine (one H200; ARCHITECTURE.md, "Testing on each machine"): install every package with the
# machine's preinstalled dependencies, run the whole test suite (its gpu-marked tests on
# the GPU), the examples (on the GPU) and the GPU benchmarks. Logs go to $OUT so they
# come back even when a step fails.
#   usage (on that machine):  bash scripts/gpu_check.sh [all|tests|bench|profile|downstream] [NAME...]
#     (carry build/ffi-include, made here by `bash scripts/gpu_check.sh headers`: the runtime is
#     built there against the oldest supported jaxlib's FFI headers, as its wheel is)
#     tests: install, the whole test suite (-n $(nproc), PYTEST_WORKERS to change) and the
#       examples; `tests lowering`: the tests/gpu suite compiled and run on the GPU
#       (PALLAS_GPU_TESTS=gpu), in a call of its own; bench: install, benchmarks;
#       all (default): tests and bench;
#     profile: install, Nsight Compute reports of benchmarks/gpu_profile.py's workloads;
#     downstream: install, tokamax's Pallas Triton tests on the GPU (both Pallas) and
#       benchmarks/tokamax_attention.py (NAME tests or bench: only that; carry .whl/tokamax).
#     NAMEs (e.g. gpu_compile, or attn_fwd for profile) run only those benchmarks/workloads;
#     for tests, only those steps (suite, examples, lowering).
#   One device call may run at most 10 minutes: `all` can exceed it, so run tests and bench
#   as two calls when the benchmarks are included. Compiling on the device costs its time:
#   `python benchmarks/gpu_matmul.py --prewarm` (or gpu_attention.py --prewarm) on a CPU with
#   PALLAS_GPU_CACHE_DIR=build/gpu-cache fills a cache to carry (device tool: carry
#   build/gpu-cache) and export PALLAS_GPU_CACHE_DIR=$PWD/build/gpu-cache before this script.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-logs}"; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
step() { echo; echo "=== $* ($(date +%T))"; }

if [ "${1:-}" = headers ]; then  # on a CPU machine with a network: jaxlib 0.10.2's headers to carry
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 jaxlib==0.10.2 -d "$tmp" || exit 1
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('jaxlib/include/')]" "$tmp"/jaxlib-*.whl "$tmp"
  rm -rf build/ffi-include && mkdir -p build && mv "$tmp/jaxlib/include" build/ffi-include && rm -rf "$tmp"
  grep -E "define XLA_FFI_API_(MAJOR|MINOR)" build/ffi-include/xla/ffi/api/c_api.h
  exit 0
fi

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"

step "install"
# The runtime builds against the oldest supported jaxlib's FFI headers (0.10.2, API 0.3), which
# that machine lacks: carry them (`bash scripts/gpu_check.sh headers` here copies them into
# build/ffi-include; device tool: carry build/ffi-include). Without them the runtime is built for
# the machine's own jaxlib only (its FFI API), which tests the same C++ against newer headers.
FFI_DEFINE=(-C "cmake.define.XLA_FFI_INCLUDE_DIR=$PWD/build/ffi-include")
if [ ! -f build/ffi-include/xla/ffi/api/c_api.h ]; then
  api=$(python3 -c "import re, os, jaxlib; h=open(os.path.join(os.path.dirname(jaxlib.__file__), 'include/xla/ffi/api/c_api.h')).read(); print(re.search(r'XLA_FFI_API_MAJOR (\d+)', h)[1] + '.' + re.search(r'XLA_FFI_API_MINOR (\d+)', h)[1])")
  echo "no build/ffi-include: building the runtime for this jaxlib's FFI API $api only"
  FFI_DEFINE=(-C "cmake.define.JAX_KERNEL_RUNTIME_FFI_API=$api")
fi
[ -n "${PALLAS_SKIP_INSTALL:-}" ] && echo "skipped (PALLAS_SKIP_INSTALL: installed by an earlier step)" || \
python3 -m pip install -q --no-deps --no-build-isolation "${FFI_DEFINE[@]}" ./ ./packages/pallas-core ./packages/jax-triton \
  ./packages/pallas-gpu ./packages/pallas-tpu 2>&1 | grep -v "^WARNING" | tail -5 | tee "$OUT/install.log"
python3 -c "import pallas, pallas_gpu, jax_triton, jax_kernel_runtime as r; print('runtime driver error:', repr(r.driver_error()))" || exit 1

MODE="${1:-all}"
shift || true
ONLY=" $* "
if [ "$MODE" = downstream ]; then  # tokamax's Pallas Triton tests and attention on the GPU, JAX's Pallas and ours
  # No network there: tokamax and its dependencies travel as wheels (carry .whl/tokamax, filled on a
  # CPU machine by `pip download --no-deps -d .whl/tokamax` of tests/downstream/gpu-wheels.txt).
  step "install tokamax from .whl/tokamax"
  python3 -m pip install -q --no-deps .whl/tokamax/*.whl 2>&1 | grep -v "^WARNING" | tail -3
  [[ "$ONLY" == *" bench "* ]] || {
    step "tokamax's tests reaching a Pallas Triton kernel, compiled on the GPU: JAX's Pallas, then ours"
    python3 tests/downstream/run_tokamax.py --way gpu --jobs "${PYTEST_WORKERS:-4}" --out "$OUT/tokamax" 2>&1 | tail -40
  }
  [[ "$ONLY" == *" tests "* ]] || { step "benchmark tokamax attention"; python3 benchmarks/tokamax_attention.py 2>&1 | tail -12; }
  exit 0
fi
if [ "$MODE" = profile ]; then  # Nsight Compute reports of benchmarks/gpu_profile.py's workloads
  command -v ncu >/dev/null || { echo "ncu not found"; exit 1; }
  python3 benchmarks/gpu_profile.py --list | while read -r w regex; do
    [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $w "* ]] || continue
    step "profile $w (kernels matching $regex)"
    python3 benchmarks/gpu_profile.py "$w" || continue  # compile and autotune into the disk cache first
    ncu --clock-control none --profile-from-start off -k "regex:$regex" -c 8 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats python3 benchmarks/gpu_profile.py "$w" 2>&1 \
      | grep -v "^==PROF==" | tee -a "$OUT/ncu.txt"
  done
  exit 0
fi
if [ "$MODE" != bench ]; then
# Many test processes share the GPU: none may take most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
WORKERS="${PYTEST_WORKERS:-$(nproc)}"
# tests mode's NAMEs: suite, examples (the default: 7-8 minutes together), lowering (a call of its own)
wants() { [[ "$ONLY" == *" $1 "* ]] || { [ "$ONLY" = "  " ] && [ "$1" != lowering ]; }; }
if wants suite; then
step "the whole test suite, every package (gpu-marked tests on the GPU, the rest as on a CPU machine)"
# Full log to $OUT; the summary (failures, slowest tests, counts) here.
# PYTEST_PATHS (default: tests) splits the suite over two device calls when one call's 10 minutes are short.
python3 -m pytest -q -rfE --durations=15 -n "$WORKERS" -p no:cacheprovider ${PYTEST_PATHS:-tests} > "$OUT/tests.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR) |passed|failed|slowest|^[0-9.]+s (call|setup)" "$OUT/tests.log" | tail -80
fi

if wants lowering; then
step "pallas-gpu lowering tests compiled and run on the GPU (the CPU suite, PALLAS_GPU_TESTS=gpu)"
PALLAS_GPU_TESTS=gpu python3 -m pytest -q -n "$WORKERS" -p no:cacheprovider tests/gpu \
  > "$OUT/tests_gpu_lowering.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests_gpu_lowering.log" | tail -60
fi

if wants examples; then
step "examples on the GPU"
python3 examples/run_all.py 2>&1 | tail -30 | tee "$OUT/examples.log"
fi

fi
[ "$MODE" = tests ] && exit 0
for b in benchmarks/gpu_*.py benchmarks/memory_bound.py benchmarks/decode_attention.py benchmarks/revisit_loop.py \
  benchmarks/triton_kernels.py benchmarks/runtime_launch_overhead.py; do
  [ -f "$b" ] && [ "$b" != benchmarks/gpu_profile.py ] || continue  # gpu_profile: the profile mode
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $(basename "$b" .py) "* ]] || continue
  # The attention benchmark's defaults rows and its sweep take minutes (its tuned rows more).
  args=(); limit=240
  [ "$b" = benchmarks/gpu_attention.py ] && { args=(--defaults-only); limit=540; }
  step "benchmark $b ${args[*]}"
  timeout "$limit" python3 "$b" "${args[@]}" 2>&1 | tee "$OUT/$(basename "$b" .py).log"
done
echo "done"
