#!/usr/bin/env bash
# scripts/tpu_chip_check.py on the lent TPU machine (device kind tpu-v5e: Python 3.11, JAX 0.10.2
# preinstalled, no network, a package index on its disk at /opt/pypi/simple; seen 2026-12-04: that index
# and /opt/wheels hold JAX 0.10.2 and libtpu 0.0.42.1 only, so the install below finds nothing). Installs JAX 0.11.2
# (our oldest) with libtpu from that index into /tmp/site, puts it and our pure-Python packages
# (pallas-core, pallas-tpu: nothing to build) first on PYTHONPATH, prints the TPU examples'
# result lines and runs the check; results go to $OUT (or build/tpu_chip_check).
#   run(kind="tpu-v5e", command="bash scripts/tpu_chip_check.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/tpu_chip_check}
mkdir -p "$OUT"
SITE=/tmp/site
python3 --version
echo "index: $(ls /opt/pypi/simple/jax/ 2>/dev/null | grep -o 'jax-0\.1[0-9.]*-py3' | sort -uV | tr '\n' ' ')"
echo "index: $(ls /opt/pypi/simple/libtpu/ 2>/dev/null | grep -o 'libtpu-[0-9.]*-' | sort -uV | tail -4 | tr '\n' ' ')"
PIP_CONFIG_FILE=/dev/null timeout 120 python3 -m pip install -q --isolated --only-binary=:all: \
  --index-url file:///opt/pypi/simple --target "$SITE" "jax[tpu]==0.11.2" 2>&1 | tail -3
export PYTHONPATH="$SITE:$PWD/packages/pallas-core/src:$PWD/packages/pallas-tpu/src${PYTHONPATH:+:$PYTHONPATH}"
python3 scripts/tpu_chip_check.py --out "$OUT" 2>&1 | tee "$OUT/log.txt" | grep -v "^WARNING\|^I0000\|^E0000"
rc=${PIPESTATUS[0]}
for ex in tpu_matmul tpu_flash_attention; do
  timeout 120 python3 "examples/$ex.py" --runs 5 2>&1 | grep -E "PASS|FAIL|backend|Error" | tail -4
done
exit "$rc"
