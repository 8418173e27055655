"""Exports the kernels of ``scripts/tpu_chip_check.py`` (JAX's TPU ops ported to ours), lowered
by our Mosaic lowering and by JAX's, for a TPU machine whose JAX is older than the one lowering
them here (features of JAX >= 0.11, or a newer JAX's lowering).

    python scripts/tpu_chip_export.py --out build/tpu_chip_bundle [--probes]

The lent TPU v5e has Python 3.11 with JAX 0.10.2 and libtpu 0.0.42.1 only, and no network. Our
packages run there themselves (``scripts/tpu_check.sh``); a newer JAX, whose wheels are larger
than a device call may carry, does not. What a TPU runs of a Pallas kernel is the Mosaic module inside XLA's
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

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "tpu"), str(HERE.parent / "tests")]

import chip_bundle  # noqa: E402
import tpu_chip_check as check  # noqa: E402
from ways.mosaic import TPU_V5E  # noqa: E402

t = check.t


def _probes():
    """(name, body, input, out_shape): the 8-bit widening probes of 2026-12-06. On the v5e,
    ``(b & 0xff) << 16`` of byte 2 of an int8 [8, 128, 4] block came out 0 wherever the byte
    was 0x01-0x7f, from JAX's lowering as from ours; the other forms came out right."""
    rng = np.random.default_rng(0)
    x3 = jnp.asarray(rng.integers(-128, 128, (8, 128, 4)), jnp.int8)
    x2 = jnp.asarray(rng.integers(-128, 128, (32, 128)), jnp.int8)
    i32 = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    u = lambda v: v.astype(jnp.int32) & 0xFF  # noqa: E731
    yield (
        "astype int32 of int8[32,128]",
        lambda v: v.astype(jnp.int32),
        x2,
        jax.ShapeDtypeStruct((32, 128), jnp.int32),
    )
    yield "byte 2 of int8[8,128,4] widened", lambda v: v[..., 2].astype(jnp.int32), x3, i32
    yield "(byte 2 & 0xff) << 16 (wrong on the v5e)", lambda v: u(v[..., 2]) << 16, x3, i32
    yield (
        "bytes or-ed, each (b & 0xff) << 8j (wrong on the v5e)",
        lambda v: u(v[..., 0]) | (u(v[..., 1]) << 8) | (u(v[..., 2]) << 16) | (u(v[..., 3]) << 24),
        x3,
        i32,
    )


def _add_probes(out, v5e) -> int:
    from jax.experimental import pallas as jpl

    import pallas as pl

    n = 0
    for name, body, x, out_shape in _probes():

        def kernel(x_ref, o_ref, body=body):
            o_ref[...] = body(x_ref[...])

        chip_bundle.add(
            out,
            f"8-bit probe: {name}",
            lambda kernel=kernel, x=x, s=out_shape: pl.pallas_call(kernel, out_shape=s)(x),
            [jax.jit(body)(x)],
            theirs=lambda kernel=kernel, x=x, s=out_shape: jpl.pallas_call(kernel, out_shape=s)(x),
            context=v5e,
        )
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/tpu_chip_bundle")
    ap.add_argument("--probes", action="store_true", help="also the 8-bit widening probes (see _probes)")
    args = ap.parse_args()
    sys.meta_path.insert(0, t._PortedOpsFinder())
    # JAX's lowering asks the device for its TPU generation: a v5e is named.
    v5e = lambda: jax.sharding.use_abstract_mesh(TPU_V5E)  # noqa: E731
    n = _add_probes(args.out, v5e) if args.probes else 0
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
