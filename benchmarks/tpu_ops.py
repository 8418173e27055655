"""JAX's own TPU ops lowered by our Mosaic lowering beside JAX's lowering and XLA, on a TPU.

    python benchmarks/tpu_ops.py [--only NAME ...] [--smoke]

Each op is JAX's installed source (``jax.experimental.pallas.ops.tpu``), once unchanged
(JAX's Pallas lowers it) and once after the import change to ours
(``tests/tpu/test_jax_tpu_ops.py``'s port: only its Pallas import lines are rewritten).
Arguments are made on the chip from a seed; each row is the median of alternating timed
rounds (``_timing.measure``) of ours, JAX's lowering and XLA's own computation of the same
result, in TFLOP/s (causal attention counts the half that is computed), with the ratios
ours/JAX and ours/XLA. The v5e's bf16 peak is about 197 TFLOP/s.

On a TPU this is the benchmark of ``scripts/tpu_check.sh bench``. ``--smoke`` runs tiny
shapes in the TPU interpret modes on a CPU, which checks the script, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "tpu"), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PEAK_V5E = 197.0


def _ported():
    """(ours, JAX's) loaders of the op modules."""
    import test_jax_tpu_ops as t

    sys.meta_path.insert(0, t._PortedOpsFinder())
    return t.load, t.load_jax


def _contexts(smoke: bool):
    if not smoke:
        return contextlib.nullcontext, contextlib.nullcontext
    from jax.experimental.pallas import tpu as jpltpu

    import pallas_tpu as pltpu

    return (
        lambda: pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()),
        lambda: jpltpu.force_tpu_interpret_mode(jpltpu.InterpretParams()),
    )


def _rand(seed, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _attention_ref(q, k, v, causal, sm_scale):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if causal:
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, k.shape[2]), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


def flash(shape, *, causal, backward, block):
    b, h, n, d = shape
    q, k, v = (_rand(i, shape) for i in range(3))
    sm_scale = 1.0 / np.sqrt(d)

    def make(mod):
        bs = mod.BlockSizes(
            block_q=block, block_k_major=block, block_k=block, block_b=1,
            block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
            block_k_major_dq=block, block_k_dq=block, block_q_dq=block,
        )  # fmt: skip
        fwd = functools.partial(mod.flash_attention, causal=causal, sm_scale=sm_scale, block_sizes=bs)
        return fwd

    def xla(q, k, v):
        return _attention_ref(q, k, v, causal, sm_scale)

    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    if backward:
        flops *= 3.5  # fwd + bwd (recompute of the scores, dq, dk, dv): 2.5x the forward

        def grad_of(fn):
            def loss(q, k, v):
                return jnp.sum(fn(q, k, v).astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1, 2))

        return "flash_attention", (q, k, v), lambda m: grad_of(make(m)), grad_of(xla), flops
    return "flash_attention", (q, k, v), make, xla, flops


def matmul(m, k, n, *, bm, bk, bn):
    x, y = _rand(0, (m, k)), _rand(1, (k, n))

    def make(mod):
        return functools.partial(mod.matmul, block_shape=(bm, bn), block_k=bk)

    return "matmul", (x, y), make, jnp.dot, 2.0 * m * k * n


def gmm(groups, m, k, n, *, tiling):
    lhs, rhs = _rand(0, (m, k)), _rand(1, (groups, k, n))
    # Uneven groups (a routing histogram), summing to m.
    w = np.random.default_rng(0).dirichlet(np.ones(groups) * 4)
    sizes = np.floor(w * m).astype(np.int32)
    sizes[-1] += m - sizes.sum()
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def make(mod):
        return functools.partial(mod.gmm, preferred_element_type=jnp.bfloat16, tiling=tiling)

    def xla(lhs, rhs, gs):
        return jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.bfloat16)

    return "megablox.gmm", (lhs, rhs, group_sizes), make, xla, 2.0 * m * k * n


def workloads(smoke: bool):
    if smoke:
        return {
            "flash fwd (smoke)": flash((1, 2, 256, 128), causal=False, backward=False, block=128),
            "flash fwd+bwd causal (smoke)": flash((1, 2, 256, 128), causal=True, backward=True, block=128),
            "matmul (smoke)": matmul(256, 256, 256, bm=128, bk=128, bn=128),
            "gmm (smoke)": gmm(4, 512, 256, 256, tiling=(128, 128, 128)),
        }
    return {
        "flash fwd B2 H16 L4096 D128": flash((2, 16, 4096, 128), causal=False, backward=False, block=512),
        "flash fwd causal B2 H16 L4096 D128": flash(
            (2, 16, 4096, 128), causal=True, backward=False, block=512
        ),
        "flash fwd+bwd causal B2 H16 L4096 D128": flash(
            (2, 16, 4096, 128), causal=True, backward=True, block=512
        ),
        "flash fwd B1 H16 L8192 D128": flash((1, 16, 8192, 128), causal=False, backward=False, block=512),
        "matmul 8192^3": matmul(8192, 8192, 8192, bm=512, bk=1024, bn=512),
        "matmul 16384x8192x8192": matmul(16384, 8192, 8192, bm=512, bk=1024, bn=512),
        "gmm G8 8192x2048x2048": gmm(8, 8192, 2048, 2048, tiling=(512, 1024, 1024)),
        "gmm G16 16384x4096x4096": gmm(16, 16384, 4096, 4096, tiling=(512, 1024, 1024)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the workload names to run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off a TPU)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not a.smoke:
        print("no TPU here: run on a TPU, or pass --smoke to check the script in interpret mode")
        return 2
    load, load_jax = _ported()
    ours_ctx, jax_ctx = _contexts(a.smoke)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(
        f"{'workload':42s} {'ours':>8s} {'JAX':>8s} {'XLA':>8s} {'ours/JAX':>9s} {'ours/XLA':>9s} {'peak':>6s}"
    )
    failed = 0
    for name, (module, args, make, xla, flops) in workloads(a.smoke).items():
        if a.only and not any(s in name for s in a.only):
            continue
        try:
            args = [jax.device_put(x) for x in args]
            mod_ours = load(module)
            mod_jax = load_jax(module)
            with ours_ctx():
                f_ours = jax.jit(make(mod_ours))
                out_ours = jax.block_until_ready(f_ours(*args))
            with jax_ctx():
                f_jax = jax.jit(make(mod_jax))
                out_jax = jax.block_until_ready(f_jax(*args))
            f_xla = jax.jit(xla)
            out_xla = f_xla(*args)
            err = max(
                float(jnp.max(jnp.abs(jnp.asarray(o, jnp.float32) - jnp.asarray(r, jnp.float32))))
                for o, r in zip(jax.tree.leaves(out_ours), jax.tree.leaves(out_jax))
            )
            err_xla = max(
                float(
                    jnp.max(jnp.abs(jnp.asarray(o, jnp.float32) - jnp.asarray(r, jnp.float32)))
                    / (jnp.max(jnp.abs(jnp.asarray(r, jnp.float32))) + 1e-30)
                )
                for o, r in zip(jax.tree.leaves(out_ours), jax.tree.leaves(out_xla))
            )

            def sync(x):
                return jax.block_until_ready(x)

            if a.smoke:
                times = {"ours": 1.0, "jax": 1.0, "xla": 1.0}
            else:
                times = _timing.measure(
                    {
                        "ours": (lambda: f_ours(*args), sync),
                        "jax": (lambda: f_jax(*args), sync),
                        "xla": (lambda: f_xla(*args), sync),
                    },
                    rounds=a.rounds,
                    min_round_s=0.2,
                )
            tf = {k: flops / t / 1e12 for k, t in times.items()}
            print(
                f"{name:42s} {tf['ours']:8.1f} {tf['jax']:8.1f} {tf['xla']:8.1f} {tf['ours'] / tf['jax']:9.3f} "
                f"{tf['ours'] / tf['xla']:9.3f} {tf['ours'] / PEAK_V5E:6.1%}   |ours-JAX| {err:.2g}, vs XLA (rel) {err_xla:.2g}",
                flush=True,
            )
        except Exception as e:  # one failing workload does not hide the others
            if a.smoke:
                raise
            failed += 1
            print(f"{name:42s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
