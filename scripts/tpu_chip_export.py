"""Exports the kernels of ``scripts/tpu_chip_check.py`` (JAX's TPU ops ported to ours), lowered
by our Mosaic lowering and by JAX's, for a TPU machine whose JAX is older than the oldest we
support.

    python scripts/tpu_chip_export.py --out build/tpu_chip_bundle

The lent TPU v5e has Python 3.11 with JAX 0.10.2 and libtpu 0.0.42.1 only, and no network;
our packages need JAX 0.11.2 (Python 3.12), whose wheels are larger than a device call may
carry. What a TPU runs of a Pallas kernel is the Mosaic module inside XLA's
``tpu_custom_call``, so this script (on any machine with our packages and libtpu) exports each
kernel for platform ``tpu`` into a bundle (``tests/tpu/chip_bundle.py`` says what it holds)
that ``scripts/tpu_chip_run.py`` runs there with JAX alone. The references are plain ``jnp``
at ``precision="highest"``, computed here. The three-way tests add their compiled-way kernels
to a bundle too (``PALLAS_TPU_CHIP_BUNDLE=DIR pytest -k compiled tests/tpu``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "tpu")]

import chip_bundle  # noqa: E402
import tpu_chip_check as check  # noqa: E402

t = check.t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/tpu_chip_bundle")
    args = ap.parse_args()
    sys.meta_path.insert(0, t._PortedOpsFinder())
    # JAX's lowering asks the device for its TPU generation: a v5e is named.
    v5e = lambda: chip_bundle.jax.sharding.use_abstract_mesh(t.three_way.TPU_V5E)  # noqa: E731
    n = 0
    for name, run, refs in check._cases():
        stem = chip_bundle.add(
            args.out,
            f"jax_tpu_ops: {name}",
            lambda run=run: run(t.load),
            refs,
            theirs=lambda run=run: run(t.load_jax),
            context=v5e,
            tolerance=check.TOL_REF,
            tolerance_vs_jax=check.TOL_JAX,
        )
        print(f"exported {name} -> {stem}")
        n += 1
    print(f"{n} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
