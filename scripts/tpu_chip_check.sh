#!/usr/bin/env bash
# Kernels lowered here by a newer JAX, run on the lent TPU v5e (device kind tpu-v5e), whose
# Python 3.11 has JAX 0.10.2 and libtpu 0.0.42.1 and no network. Our packages install and run there
# themselves (scripts/tpu_check.sh); this path is for what needs JAX >= 0.11 (its Pallas features,
# the lowering of a newer JAX), whose wheels with libtpu are larger than a device call may carry.
# The kernels travel lowered: on this machine,
#   python scripts/tpu_chip_export.py --out build/tpu_chip_bundle
#   PALLAS_TPU_CHIPS=v5e PALLAS_TPU_CHIP_BUNDLE=$PWD/build/tpu_chip_bundle pytest -n 2 -k compiled tests/tpu
#   python -m pip download --no-deps --only-binary=:all: -d build/tpu_chip_bundle flatbuffers
#   tar cJf build/tpu_chip_bundle.tar.xz -C build tpu_chip_bundle
# exports JAX's TPU ops ported to ours (scripts/tpu_chip_check.py's cases) through our lowering and
# through JAX's, with their jnp references, then every three-way test kernel of the compiled way
# (ours and JAX's lowering, run_mosaic's outputs as the reference), and the wheel jax.export's
# deserializer needs, which that machine lacks; there, JAX alone runs them (scripts/tpu_chip_run.py,
# which serializes each Mosaic module again with that JAX's serializer) and compares.
#   run(kind="tpu-v5e", carry=["build/tpu_chip_bundle.tar.xz"], command="bash scripts/tpu_chip_check.sh")
# On a TPU machine with our packages installed (any supported JAX), scripts/tpu_chip_check.py runs
# the ops directly and also compares with JAX's own compiled kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/tpu_chip_check}
BUNDLE=${BUNDLE:-build/tpu_chip_bundle}
mkdir -p "$OUT"
python3 --version
# A bundle travels as $BUNDLE.tar.xz (the three-way kernels' inputs and outputs compress 3:1).
[ -d "$BUNDLE" ] || [ ! -f "$BUNDLE.tar.xz" ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BUNDLE.tar.xz" "$(dirname "$BUNDLE")"
ls "$BUNDLE"/*.json >/dev/null 2>&1 || { echo "no bundle at $BUNDLE: see the top of this script"; exit 1; }
python3 scripts/tpu_chip_run.py "$BUNDLE" --out "$OUT" 2>&1 | tee "$OUT/log.txt" | grep -v "^WARNING\|^I0000\|^E0000"
exit "${PIPESTATUS[0]}"
