#!/usr/bin/env bash
# The one call on the lent TPU v5e (ARCHITECTURE.md, "Testing on each machine"): Python 3.11 with
# JAX 0.10.2 and libtpu there, no network. It installs our packages into that Python from the
# wheels it carries (pip --target, nothing compiled there), then runs on the chip:
#   tests:    tests/tpu's compiled way (tests/ways/chip.py: each kernel lowered by us, compiled by
#             the chip's libtpu and run there against its jnp reference, JAX's lowering run beside
#             it), in one pytest process (one program at a time holds the chip);
#   examples: the TPU examples (examples/tpu_*.py);
#   bench:    benchmarks/tpu_ops.py (JAX's TPU ops lowered by ours, by JAX's, and XLA) and the
#             pallas_tpu.ops benchmarks (benchmarks/tpu_ops_*.py) where present.
# Prepare on a CPU machine (pure-Python wheels of pallas-core and pallas-tpu into build/tpu-wheels):
#   bash scripts/tpu_check.sh prepare
# then (device tool):
#   run(kind="tpu-v5e", carry=["build/tpu-wheels"], command="bash scripts/tpu_check.sh [all|tests|examples|bench] [ARGS]")
# ARGS go to pytest for `tests` (e.g. -k flash) and to the benchmarks for `bench` (--only NAME);
# BENCHES="benchmarks/a.py benchmarks/b.py" runs only those benchmarks.
# One device call may run 10 minutes: `all` runs tests, examples and bench in that order and
# each step's log goes to $OUT, so what finished comes back when the call is cut.
# Kernels that need JAX >= 0.11 features travel lowered instead: scripts/tpu_chip_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
shift || true
WHEELS=build/tpu-wheels

if [ "$MODE" = prepare ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  python3 -m pip wheel -q --no-deps -w "$WHEELS" ./packages/pallas-core ./packages/pallas-tpu || exit 1
  ls -l "$WHEELS"
  exit 0
fi

export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/build/tpu-logs}"; mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

step "install our wheels into /tmp/site (PYTHONPATH keeps the machine's JAX first)"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: run 'bash scripts/tpu_check.sh prepare' first"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$WHEELS"/*.whl 2>&1 | grep -v "^WARNING" | tail -3
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
python3 -c "import sys, jax, pallas, pallas_tpu; print('python', sys.version.split()[0], 'jax', jax.__version__, 'pallas', pallas.__version__, 'pallas_tpu', pallas_tpu.__version__, jax.devices())" || exit 1

status=0
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  step "tests/tpu, the compiled way, on the chip"
  ARGS=("$@"); [ "$MODE" = all ] && ARGS=()
  python3 -m pytest tests/tpu -k compiled -q -rs -p no:cacheprovider \
    --durations=10 "${ARGS[@]}" > "$OUT/tests.log" 2>&1
  rc=$?; echo "pytest exit status $rc"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR) |^SKIPPED|passed|failed|TPU kernels run|kernels:|^  tests/" "$OUT/tests.log" | tail -60
fi

if [ "$MODE" = all ] || [ "$MODE" = examples ]; then
  step "the TPU examples on the chip"
  for ex in examples/tpu_*.py; do
    python3 "$ex" > "$OUT/$(basename "$ex" .py).log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    grep -E ": (PASS|FAIL)|backend|Error|skip" "$OUT/$(basename "$ex" .py).log" | tail -6
    echo "$ex: exit status $rc"
  done
fi

if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  for b in ${BENCHES:-benchmarks/tpu_ops.py benchmarks/tpu_ops_*.py}; do
    [ -f "$b" ] || continue
    step "benchmark $b"
    ARGS=("$@"); [ "$MODE" = all ] && ARGS=()
    python3 "$b" "${ARGS[@]}" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tee "$OUT/$(basename "$b" .py).txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
exit $status
