#!/usr/bin/env bash
# The one call on the GPU machine (../shared/GPU.md): install every package with the
# machine's preinstalled dependencies, run all GPU tests, the examples (on the GPU) and
# the GPU benchmarks. Logs go to $OUT so they come back even when a step fails.
#   usage (device tool):  bash scripts/gpu_check.sh [all|tests|bench|profile] [NAME...]
#     tests: install, GPU tests, examples; bench: install, benchmarks; all (default): both;
#     profile: install, Nsight Compute reports of benchmarks/gpu_profile.py's workloads.
#     NAMEs (e.g. gpu_compile, or attn_fwd for profile) run only those benchmarks/workloads.
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

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"

step "install"
[ -n "${PALLAS_SKIP_INSTALL:-}" ] && echo "skipped (PALLAS_SKIP_INSTALL: installed by an earlier step)" || \
python3 -m pip install -q --no-deps --no-build-isolation ./ ./packages/pallas-core ./packages/jax-triton \
  ./packages/pallas-gpu ./packages/pallas-tpu 2>&1 | grep -v "^WARNING" | tail -5 | tee "$OUT/install.log"
python3 -c "import pallas, pallas_gpu, jax_triton, jax_kernel_runtime as r; print('runtime driver error:', repr(r.driver_error()))" || exit 1

MODE="${1:-all}"
shift || true
ONLY=" $* "
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
step "GPU tests (all packages)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -60 | tee "$OUT/tests.log"

step "pallas-gpu lowering tests compiled and run on the GPU (the CPU suite, PALLAS_GPU_TESTS=gpu)"
PALLAS_GPU_TESTS=gpu XLA_PYTHON_CLIENT_PREALLOCATE=false \
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu 2>&1 | tail -60 | tee "$OUT/tests_gpu_lowering.log"

step "examples on the GPU"
python3 examples/run_all.py 2>&1 | tail -30 | tee "$OUT/examples.log"

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
