#!/usr/bin/env bash
# On the GPU machine (see ../shared/GPU.md): build + install jax-kernel-runtime
# and jax-triton, run their GPU tests, then every benchmark, in one call.
# Logs go to $OUT (or ./gpu-logs) so they come back even if a step fails.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

step() { echo; echo "=== $* ==="; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, triton, torch; print('jax', jax.__version__, 'triton', triton.__version__, 'torch', torch.__version__, jax.devices())"

step "install (no deps, no build isolation)"
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation ./ ./packages/jax-triton 2>&1 | tail -5 | tee "$OUT/install.log"
echo "install took $(( $(date +%s) - t0 )) s"
python3 -c "import jax_kernel_runtime as j; print('driver error:', repr(j.driver_error()))" || exit 1

step "examples"
for e in add softmax matmul flash_attention; do python3 "examples/triton_$e.py" 2>&1 | tail -3; done | tee "$OUT/examples.log"

step "GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime tests/jax_triton -o addopts="" \
  2>&1 | tail -40 | tee "$OUT/tests.log"

step "benchmark: launch overhead"
python3 benchmarks/runtime_launch_overhead.py 2>&1 | tee "$OUT/bench_launch.log"

step "benchmark: kernels vs torch launch and XLA"
python3 benchmarks/triton_kernels.py 2>&1 | tee "$OUT/bench_kernels.log"
echo "done"
