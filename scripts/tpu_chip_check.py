"""JAX's own TPU kernels, ported to our packages by the import change, compiled and run
on a real TPU: each beside JAX's unmodified kernel compiled by JAX on the same chip and
a plain ``jnp`` reference at ``precision="highest"``.

    python scripts/tpu_chip_check.py [--out DIR] [--interpret]

On a TPU the ported kernels go through our Mosaic lowering and libtpu's Mosaic compiler
and run on the chip; JAX's go through JAX's lowering. Off a TPU (or with
``--interpret``) both sides run in their TPU interpret modes, which checks this script
on a CPU. Prints one line per kernel output (max |ours - JAX| and max |ours - jnp|,
relative to max |jnp|) and writes ``tpu_chip_check.json`` into ``--out``. Exits 1 when
a kernel fails to compile or run, or an error exceeds its tolerance.

The kernels and their inputs come from ``tests/tpu/test_jax_tpu_ops.py`` (the port and
the references), so this runs what the CPU suite runs in interpret mode. How to run it on
the lent TPU machine (Python 3.11, no network): ``scripts/tpu_chip_check.sh``.

Status: checked on a CPU (``--interpret``: 8 of 8 kernels, ours and JAX's equal to 6e-8).
The lent TPU machine's JAX (0.10.2) is older than ours, so there these kernels ran lowered
here (``scripts/tpu_chip_export.py``, ``scripts/tpu_chip_run.py``): 8 of 8 equal to JAX's
lowering bit for bit, within 1.8e-2 of jnp (2026-12-06).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "tpu"), str(ROOT / "tests")]  # the test file, and tests/ways

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import test_jax_tpu_ops as t  # noqa: E402

# On a chip, f32 dots at default precision take bf16 passes on both sides: the
# tolerance against the f32 reference is relative to its largest value. Ours against
# JAX's compiled kernel: the same Mosaic compiler on the same chip.
TOL_REF = 3e-2
TOL_JAX = 1e-2


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _cases():
    """(name, run(m) -> outputs, reference outputs): ``m`` is a loader (ours or JAX's)."""

    def matmul(dtype):
        x, y = t.rand(1, (256, 512), dtype), t.rand(2, (512, 256), dtype)
        kw = dict(block_shape=(128, 128), block_k=128, out_dtype=jnp.float32)
        ref = jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32), precision="highest")
        return (lambda load: [load("matmul").matmul(x, y, **kw)]), [ref]

    def flash(causal):
        q, k, v = t._flash_inputs()
        kw = dict(causal=True, sm_scale=0.5) if causal else {}

        def run(load):
            fa = load("flash_attention")
            return [fa.flash_attention(q, k, v, block_sizes=t._flash_blocks(fa), **kw)]

        return run, [t.attention_ref(q, k, v, **kw)]

    def flash_bwd():
        q, k, v = t._flash_inputs()
        do = t.rand(30, q.shape)
        kw = dict(causal=True, sm_scale=0.5)

        def run(load):
            fa = load("flash_attention")
            f = lambda q, k, v: fa.flash_attention(q, k, v, block_sizes=t._flash_blocks(fa), **kw)  # noqa: E731
            return list(jax.vjp(f, q, k, v)[1](do))

        return run, list(jax.vjp(lambda q, k, v: t.attention_ref(q, k, v, **kw), q, k, v)[1](do))

    def paged(inline):
        args = t._paged_inputs()
        kw = dict(pages_per_compute_block=2, inline_seq_dim=inline)
        return (lambda load: [load("paged_attention").paged_attention(*args, **kw)]), [
            t.paged_attention_ref(*args)
        ]

    def gmm():
        lhs, rhs, dout = t.rand(50, (512, 256)), t.rand(51, (4, 256, 256)), t.rand(52, (512, 256))
        sizes = jnp.array([100, 0, 250, 162], jnp.int32)

        def run(load):
            out, vjp = jax.vjp(lambda a, b: load("megablox.ops").gmm(a, b, sizes), lhs, rhs)
            return [out, *vjp(dout)]

        rout, rvjp = jax.vjp(lambda a, b: t.gmm_ref(a, b, sizes), lhs, rhs)
        return run, [rout, *rvjp(dout)]

    yield "matmul f32", *matmul(jnp.float32)
    yield "matmul bf16", *matmul(jnp.bfloat16)
    yield "flash_attention fwd", *flash(False)
    yield "flash_attention fwd causal", *flash(True)
    yield "flash_attention bwd (dq, dk, dv)", *flash_bwd()
    yield "paged_attention inline_seq_dim", *paged(True)
    yield "paged_attention", *paged(False)
    yield "megablox gmm fwd+bwd (out, dlhs, drhs)", *gmm()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--interpret", action="store_true", help="TPU interpret mode on both sides")
    args = ap.parse_args()
    on_chip = jax.default_backend() == "tpu" and not args.interpret
    print(
        f"jax {jax.__version__}, devices {jax.devices()}, {'compiled on the chip' if on_chip else 'interpret'}"
    )
    sys.meta_path.insert(0, t._PortedOpsFinder())
    ours = contextlib.nullcontext if on_chip else t.ours
    theirs = contextlib.nullcontext if on_chip else t.theirs
    rows, failed = [], 0
    for name, run, refs in _cases():
        row = {"kernel": name}
        try:
            start = time.perf_counter()
            with ours():
                out = jax.block_until_ready(run(t.load))
            row["ours_s"] = round(time.perf_counter() - start, 2)
            with theirs():
                jout = jax.block_until_ready(run(t.load_jax))
            row["vs_jax"] = [_rel(a, b) for a, b in zip(out, jout)]
            row["vs_ref"] = [_rel(a, r) for a, r in zip(out, refs)]
            row["jax_vs_ref"] = [_rel(b, r) for b, r in zip(jout, refs)]
            row["ok"] = max(row["vs_jax"]) <= TOL_JAX and max(row["vs_ref"]) <= TOL_REF
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(
                ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}", tb=traceback.format_exc()[-4000:]
            )
        failed += not row["ok"]
        fmt = lambda xs: ",".join(f"{x:.1e}" for x in xs)  # noqa: E731
        if "error" in row:
            print(f"FAIL {name}: {row['error'][:500]}")
        else:
            print(
                f"{'ok  ' if row['ok'] else 'FAIL'} {name}: ours vs JAX {fmt(row['vs_jax'])}; ours vs jnp "
                f"{fmt(row['vs_ref'])} (JAX vs jnp {fmt(row['jax_vs_ref'])}); first call {row['ours_s']} s"
            )
        rows.append(row)
    summary = {
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "on_chip": on_chip,
        "tolerances": {"vs_jax": TOL_JAX, "vs_ref": TOL_REF},
        "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tpu_chip_check.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(rows) - failed} of {len(rows)} kernels ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
