"""Launch cost of triton_call against XLA's own ops, in one run.

1. 1000 tiny triton_calls inside one jitted fori_loop vs 1000 tiny XLA
   elementwise ops in the same loop (whole loop, wall clock = device timeline
   plus one dispatch), out of place, in place, and with XLA's while-loop
   double buffering; JAX's own Pallas in the same loop for reference.
   Target ratio <= 1.1.
2. host time of a single jitted tiny triton_call dispatch vs a jitted tiny
   XLA op (median per call; async dispatch throughput too). Target <= 1.05.
"""

import time

import jax
import numpy as np
import triton
import triton.language as tl

import jax_triton as jt


@triton.jit
def axpb_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 1.0001 + 1.0, mask=mask)


def tiny_triton(x):
    return jt.triton_call(x, kernel=axpb_kernel, out_shape=x, grid=1, n=x.size, BLOCK=128)


def tiny_triton_inplace(x):
    # Writing in place lets XLA keep the loop carry in one buffer (no copy).
    return jt.triton_call(
        x,
        kernel=axpb_kernel,
        out_shape=x,
        grid=1,
        n=x.size,
        BLOCK=128,
        input_output_aliases={0: 0},
    )


def tiny_xla(x):
    return x * 1.0001 + 1.0


def tiny_jax_pallas():
    """The same tiny kernel in JAX's own Pallas (a reference), or None."""
    try:
        from jax.experimental import pallas as jpl
        from jax.experimental.pallas import triton as jplt
    except Exception:  # noqa: BLE001
        return None

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 1.0001 + 1.0

    cp = jplt.CompilerParams(num_warps=1)
    return lambda x: jpl.pallas_call(kernel, out_shape=x, compiler_params=cp)(x)


def loop(step, steps=1000):
    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda i, x: step(x), x))


# XLA keeps a while loop's carry in one buffer. An XLA fusion may write its
# result over its input; a custom call (ours or JAX Pallas') writes a fresh
# buffer that XLA then copies into the carry, once per iteration. Unrolling
# the loop by two (XLA's double buffering) lets two buffers alternate instead.
DOUBLE_BUFFERING = {"xla_gpu_enable_while_loop_double_buffering": True}


def median_time(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def loop_section(x):
    steps = {"xla": tiny_xla, "triton_call": tiny_triton, "triton_call in-place": tiny_triton_inplace}
    if (jp := tiny_jax_pallas()) is not None:
        steps["JAX Pallas (reference)"] = jp
    ref = loop(tiny_xla)(x)
    print("fori_loop of 1000 tiny ops, per iteration (whole loop / 1000), ratio to XLA in the same loop:")
    for opts_name, opts in (("default XLA options", {}), ("double buffering", DOUBLE_BUFFERING)):
        compiled = {name: loop(step).lower(x).compile(compiler_options=opts) for name, step in steps.items()}
        for c in compiled.values():
            np.testing.assert_allclose(c(x), ref, rtol=1e-5)
        # Interleave rounds so drift hits every variant alike.
        times = {name: [] for name in compiled}
        for _ in range(15):
            for name, c in compiled.items():
                times[name].append(median_time(lambda: c(x).block_until_ready(), 1))
        t_xla = float(np.median(times["xla"]))
        for name in compiled:
            t = float(np.median(times[name]))
            copies = compiled[name].as_text().count(" copy(")
            print(
                f"  [{opts_name}] {name:24s} {t * 1e3:7.2f} us/iter  ratio {t / t_xla:.3f}  (copies in HLO: {copies})"
            )


def main():
    x = jax.random.normal(jax.random.key(0), (128,))
    loop_section(x)

    ft, fx = jax.jit(tiny_triton), jax.jit(tiny_xla)
    ft(x).block_until_ready(), fx(x).block_until_ready()
    n = 2000
    d_tri = median_time(lambda: ft(x).block_until_ready(), n)
    d_xla = median_time(lambda: fx(x).block_until_ready(), n)
    print(f"single dispatch (blocking, median of {n}): triton_call {d_tri * 1e6:.1f} us  xla {d_xla * 1e6:.1f} us  "
          f"ratio triton_call/xla = {d_tri / d_xla:.3f}")  # fmt: skip

    def burst(f):
        out = None
        t0 = time.perf_counter()
        for _ in range(1000):
            out = f(x)
        t1 = time.perf_counter()
        out.block_until_ready()
        return (t1 - t0) / 1000

    a_tri = float(np.median([burst(ft) for _ in range(5)]))
    a_xla = float(np.median([burst(fx) for _ in range(5)]))
    print(f"single dispatch (async host time, median of 5x1000): triton_call {a_tri * 1e6:.1f} us  "
          f"xla {a_xla * 1e6:.1f} us  ratio triton_call/xla = {a_tri / a_xla:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
