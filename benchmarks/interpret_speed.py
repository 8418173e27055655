"""Interpret-mode speed: our `pallas` against JAX's `jax.experimental.pallas`, on the CPU.

Every kernel is written once, as a function of the `pl` module it is built with; the API is
the same, so the identical kernel runs under both. Both sides use `interpret=True`, are
jitted, get one warm-up call (compile + first run), then the median of several timed runs.
Both outputs are also compared with each other and with a plain `jnp` reference.

Targets (pallas-core issue, section 3): at least 10x faster on `add` and `matmul`, never
slower on any kernel.

Run: python benchmarks/interpret_speed.py [--repeats N] [--upstream-repeats N] [--only NAME]
     [--strict]   (exit 1 when a speed target is missed, not only on wrong results)
"""

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable

import _examples
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as upstream_pl

import pallas as ours_pl

# --- kernels: each `build_*` takes a `pl` module and returns a function of arrays ----------


def build_add(pl, block=(16, 16)):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    def add(x, y):
        spec = pl.BlockSpec(block, lambda i, j: (i, j))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(x.shape[0] // block[0], x.shape[1] // block[1]),
            in_specs=[spec, spec],
            out_specs=spec,
            interpret=True,
        )(x, y)

    return add


def build_matmul(pl, bm=64, bn=64, bk=64):
    """examples/matmul.py's kernel (k accumulated in the output block), with this ``pl``."""
    ex = _examples.load("matmul", _examples.which(pl))
    return functools.partial(ex.matmul, bm=bm, bn=bn, bk=bk, backend=_examples.INTERPRET)


def build_softmax(pl, block_rows=8):
    def kernel(x_ref, o_ref):
        x = x_ref[...]
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    def softmax(x):
        rows, cols = x.shape
        spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(rows // block_rows,),
            in_specs=[spec],
            out_specs=spec,
            interpret=True,
        )(x)

    return softmax


def build_flash_attention(pl, block_q=64, block_k=64):
    def kernel(q_ref, k_ref, v_ref, o_ref):
        q = q_ref[...] * (1.0 / math.sqrt(q_ref.shape[-1]))

        def body(step, carry):
            m, l, acc = carry
            start = pl.multiple_of(step * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            s = jnp.dot(q, k.T)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l_new = l * correction + jnp.sum(p, axis=1)
            return m_new, l_new, acc * correction[:, None] + jnp.dot(p, v)

        m = jnp.full((block_q,), -jnp.inf, jnp.float32)
        l = jnp.zeros((block_q,), jnp.float32)
        acc = jnp.zeros(q_ref.shape, jnp.float32)
        m, l, acc = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, (m, l, acc))
        o_ref[...] = acc / l[:, None]

    def flash_attention(q, k, v):  # (batch * heads, seq, head_dim)
        bh, seq, d = q.shape
        q_spec = pl.BlockSpec((None, block_q, d), lambda b, i: (b, i, 0))
        kv_spec = pl.BlockSpec((None, seq, d), lambda b, i: (b, 0, 0))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            grid=(bh, seq // block_q),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            interpret=True,
        )(q, k, v)

    return flash_attention


def attention_reference(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


# --- the benchmark table --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: str  # what is measured, for the table
    build: Callable  # build(pl) -> kernel function of the inputs
    make_inputs: Callable[[jax.Array], tuple]
    reference: Callable
    tol: float  # max abs diff allowed between ours, upstream and the jnp reference
    target: float  # required speedup (ours vs upstream)


def _normals(key, *shapes):
    return tuple(
        jax.random.normal(k, s, jnp.float32) for k, s in zip(jax.random.split(key, len(shapes)), shapes)
    )


CASES = [
    Case(
        "add",
        "1024x1024 f32, 16x16 blocks, grid 64x64",
        build_add,
        lambda key: _normals(key, (1024, 1024), (1024, 1024)),
        jnp.add,
        tol=0.0,
        target=10.0,
    ),
    Case(
        "matmul",
        "1024^3 f32, 64x64x64 blocks, grid 16x16x16 (k accumulates)",
        build_matmul,
        lambda key: _normals(key, (1024, 1024), (1024, 1024)),
        functools.partial(jnp.dot, precision="highest"),
        tol=1e-3,
        target=10.0,
    ),
    Case(
        "softmax",
        "4096x1024 f32, 8-row blocks, grid 512",
        build_softmax,
        lambda key: _normals(key, (4096, 1024)),
        functools.partial(jax.nn.softmax, axis=-1),
        tol=1e-6,
        target=1.0,
    ),
    Case(
        "flash_attention",
        "bh=16 seq=1024 d=64 f32, 64-row q/k blocks, grid 16x16",
        build_flash_attention,
        lambda key: _normals(key, *[(16, 1024, 64)] * 3),
        attention_reference,
        tol=1e-4,
        target=1.0,
    ),
]


def time_ms(fn, args, repeats):
    """(median ms of `repeats` timed calls, warm-up ms, output) of a jitted function."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    warmup = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), warmup, out


def max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of ours")
    parser.add_argument("--upstream-repeats", type=int, default=2, help="timed runs of upstream")
    parser.add_argument(
        "--only",
        action="append",
        choices=[c.name for c in CASES],
        help="run only these kernels (repeatable)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()

    same = ours_pl.pallas_call is upstream_pl.pallas_call
    print(
        f"jax {jax.__version__}, device {jax.devices()[0]}, ours: {ours_pl.__name__} from "
        f"{getattr(ours_pl, '__file__', '?')}" + ("  [SAME AS UPSTREAM: shim]" if same else "")
    )
    header = (
        "kernel",
        "problem",
        "upstream ms",
        "ours ms",
        "speedup",
        "target",
        "ours-upstream",
        "ours-jnp",
        "ok",
    )
    rows, wrong, missed = [], [], []
    for i, case in enumerate(CASES):
        if args.only and case.name not in args.only:
            continue
        inputs = case.make_inputs(jax.random.key(i))
        expected = case.reference(*inputs)
        up_ms, up_warm, up_out = time_ms(jax.jit(case.build(upstream_pl)), inputs, args.upstream_repeats)
        our_ms, our_warm, our_out = time_ms(jax.jit(case.build(ours_pl)), inputs, args.repeats)
        d_up = max_abs_diff(our_out, up_out)
        d_ref = max_abs_diff(our_out, expected)
        correct = d_up <= case.tol and d_ref <= case.tol
        speedup = up_ms / our_ms
        if not correct:
            wrong.append(case.name)
        if speedup < case.target:
            missed.append(case.name)
        rows.append(
            (
                case.name,
                case.shape,
                f"{up_ms:.1f}",
                f"{our_ms:.1f}",
                f"{speedup:.1f}x",
                f">={case.target:g}x",
                f"{d_up:.2g}",
                f"{d_ref:.2g}",
                ("ok" if correct else "WRONG") + ("" if speedup >= case.target else ", slow"),
            )
        )
        print(
            f"  {case.name}: upstream {up_ms:.1f} ms (warm-up {up_warm:.0f} ms), ours "
            f"{our_ms:.1f} ms (warm-up {our_warm:.0f} ms)",
            flush=True,
        )

    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(
        f"\nmedian of {args.upstream_repeats} (upstream) / {args.repeats} (ours) runs after one "
        "warm-up; speedup = upstream ms / ours ms; diffs are max abs differences."
    )
    if wrong:
        print(f"WRONG RESULTS: {', '.join(wrong)}")
    if missed:
        print(f"speed target missed: {', '.join(missed)}")
    return 1 if wrong or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
