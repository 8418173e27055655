"""Launch cost of triton_call against XLA's own ops, in one run.

1. 1000 tiny triton_calls inside one jitted fori_loop vs 1000 tiny XLA
   elementwise ops in the same loop (whole loop, wall clock = device timeline
   plus one dispatch).  Target ratio <= 1.1.
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


def loop(step, steps=1000):
    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda i, x: step(x), x))


def median_time(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    x = jax.random.normal(jax.random.key(0), (128,))
    lt, lx = loop(tiny_triton), loop(tiny_xla)
    np.testing.assert_allclose(lt(x), lx(x), rtol=1e-5)
    t_tri = median_time(lambda: lt(x).block_until_ready(), 20)
    t_xla = median_time(lambda: lx(x).block_until_ready(), 20)
    print(f"fori_loop 1000 tiny ops: triton_call {t_tri * 1e3:.3f} ms ({t_tri:.3e} s/1000 = {t_tri * 1e3:.2f} us/iter)  "
          f"xla {t_xla * 1e3:.3f} ms ({t_xla * 1e3:.2f} us/iter)  ratio triton_call/xla = {t_tri / t_xla:.3f}")  # fmt: skip

    li = loop(tiny_triton_inplace)
    np.testing.assert_allclose(li(x), lx(x), rtol=1e-5)
    t_inp = median_time(lambda: li(x).block_until_ready(), 20)
    print(
        f"fori_loop 1000 tiny ops, in-place triton_call: {t_inp * 1e3:.3f} ms  ratio triton_call/xla = {t_inp / t_xla:.3f}"
    )
    for name, f in (("triton_call", lt), ("in-place triton_call", li), ("xla", lx)):
        hlo = f.lower(x).compile().as_text()
        body_ops = [w for w in ("copy", "fusion", "custom-call", "command_buffer") if w in hlo]
        print(
            f"  optimized HLO of {name} loop: copies={hlo.count(' copy(')} fusions={hlo.count(' fusion(')} has={body_ops}"
        )

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
