#!/usr/bin/env bash
# pallas-gpu on the lent GPU machine, in one call: install, GPU + CPU-interpreter
# tests, benchmark. Run from the repo root: bash scripts/gpu_pallas.sh
set -u
cd "$(dirname "$0")/.."
export PALLAS_GPU_CACHE_DIR="${TMPDIR:-/tmp}/pallas_gpu_cache"
echo "== install"; t0=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation -q ./ ./packages/pallas-core ./packages/pallas-gpu 2>&1 | tail -3
echo "install took $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader || true
python3 -c "import jax; print(jax.devices())"
echo "== GPU tests (compiled kernels) + cubin checks"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_run.py tests/gpu/test_compile.py -x 2>&1 | tail -25
echo "== interpreter tests (sample)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lowering.py -k "softmax or matmul or control or cond or fori or dot" 2>&1 | tail -5
echo "== benchmark"
timeout 120 python3 benchmarks/gpu_pallas.py 2>&1 | grep -v "^WARNING" | tail -12
