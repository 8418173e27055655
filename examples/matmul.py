"""Blocked matmul with f32 accumulation over the k axis.

`o = x @ y` with `x: (m, k)`, `y: (k, n)` in bfloat16 and `o` in float32. The grid is
`(m / bm, n / bn, k / bk)`: program `(i, j, kk)` multiplies block `(i, kk)` of `x` by block
`(kk, j)` of `y` and adds the product into output block `(i, j)`. All programs with the same
`(i, j)` see the same output block, so it stays resident across the k axis: the first of them
(`kk == 0`) zeroes it, the others accumulate into it. An output block is not zero when the
kernel starts (interpret mode fills it with NaN on purpose), so the `pl.when` is required.

Accumulating along a grid axis relies on the grid running its steps in order, as interpret
mode and TPUs do. On a GPU the programs of a grid run concurrently, so there the k loop moves
inside the kernel (`matmul_k_loop`): a grid of `(m / bm, n / bn)` and a `fori_loop` over k.
On a GPU it also runs with `plgpu.CompilerParams(use_tma=True)` (`matmul_k_loop_tma`): the
same kernel, its tiles moved by Hopper's Tensor Memory Accelerator.

`matmul_grouped` is `matmul_k_loop`'s kernel on a 1-D grid whose index maps visit the output
tiles in groups of block rows (the order Triton's matmul tutorial uses: a panel of `y` is reused
from the L2 cache); the GPU benchmarks time it with our Pallas and with JAX's.

`matmul_persistent` launches one program per streaming multiprocessor (at most one per output
tile) instead of one per tile: program `p` of `P` walks the tiles `p, p + P, p + 2P, ...`, with
whole-array Refs and `pl.ds` slices for its panels. No new primitive is needed: the grid size
and `pl.program_id`/`pl.num_programs` say it all. It runs everywhere; on a GPU it saves the
launch of a program per tile (`pallas_gpu.ops.matmul`'s persistent candidates are this form).

Run: python examples/matmul.py [--size small|large]
"""

import functools

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms

import pallas as pl


def matmul_kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def matmul(x, y, *, bm, bn, bk, backend):
    (m, k), (_, n) = x.shape, y.shape
    return pl.pallas_call(
        matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        **backend.call_kwargs(),
    )(x, y)


def matmul_k_loop_kernel(x_ref, y_ref, o_ref, *, bk):
    # x_ref holds a (bm, k) row panel and y_ref a (k, bn) column panel; walk k in steps of bk.
    def body(kk, acc):
        start = pl.multiple_of(kk * bk, bk)
        x = x_ref[:, pl.ds(start, bk)]
        y = y_ref[pl.ds(start, bk), :]
        return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, acc).astype(o_ref.dtype)


def matmul_k_loop(x, y, *, bm, bn, bk, backend, **hopper):
    (m, k), (_, n) = x.shape, y.shape
    return pl.pallas_call(
        functools.partial(matmul_k_loop_kernel, bk=bk),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        **backend.call_kwargs(num_warps=4, num_stages=3, **hopper),
    )(x, y)


def grouped_tile(p, *, tiles_n, group):
    """Program ``p``'s output tile (block row, block column) in grouped order: ``group``
    block rows take each column block in turn, so its panel of y stays in the L2 cache."""
    r = jax.lax.rem(p, group * tiles_n)
    return jax.lax.div(p, group * tiles_n) * group + jax.lax.rem(r, group), jax.lax.div(r, group)


def matmul_grouped(x, y, *, bm, bn, bk, backend, group=8, out_dtype=jnp.float32, num_warps=4, num_stages=3):
    # matmul_k_loop's kernel on a 1-D grid whose index maps walk the tiles in grouped order.
    (m, k), (_, n) = x.shape, y.shape
    group = min(group, m // bm)
    assert (m // bm) % group == 0, (m, bm, group)
    tile = functools.partial(grouped_tile, tiles_n=n // bn, group=group)
    return pl.pallas_call(
        functools.partial(matmul_k_loop_kernel, bk=bk),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=((m // bm) * (n // bn),),
        in_specs=[
            pl.BlockSpec((bm, k), lambda p: (tile(p)[0], 0)),
            pl.BlockSpec((k, bn), lambda p: (0, tile(p)[1])),
        ],
        out_specs=pl.BlockSpec((bm, bn), tile),
        **backend.call_kwargs(num_warps=num_warps, num_stages=num_stages),
    )(x, y)


def matmul_persistent_kernel(x_ref, y_ref, o_ref, *, bm, bn, bk):
    # Whole-array Refs: this program computes the tiles pid, pid + P, ... of the output.
    pid, programs = pl.program_id(0), pl.num_programs(0)
    tiles_n = o_ref.shape[1] // bn
    tiles = (o_ref.shape[0] // bm) * tiles_n

    def tile_step(t, carry):
        tile = pid + t * programs
        m0 = pl.multiple_of((tile // tiles_n) * bm, bm)
        n0 = pl.multiple_of((tile % tiles_n) * bn, bn)

        def k_step(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            x = x_ref[pl.ds(m0, bm), pl.ds(k0, bk)]
            y = y_ref[pl.ds(k0, bk), pl.ds(n0, bn)]
            return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, k_step, jnp.zeros((bm, bn), jnp.float32))
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = acc
        return carry

    # This program's share of the tiles: ceil((tiles - pid) / programs).
    jax.lax.fori_loop(0, (tiles - pid + programs - 1) // programs, tile_step, 0)


def matmul_persistent(x, y, *, bm, bn, bk, backend, programs=None):
    (m, k), (_, n) = x.shape, y.shape
    tiles = (m // bm) * (n // bn)
    # One program per multiprocessor (132 on an H100/H200; a CPU device reports none: 4 there).
    programs = programs or getattr(jax.devices()[0], "core_count", 0) or 4
    return pl.pallas_call(
        functools.partial(matmul_persistent_kernel, bm=bm, bn=bn, bk=bk),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(min(tiles, programs),),
        in_specs=[pl.BlockSpec((m, k), lambda p: (0, 0)), pl.BlockSpec((k, n), lambda p: (0, 0))],
        out_specs=pl.BlockSpec((m, n), lambda p: (0, 0)),
        **backend.call_kwargs(num_warps=4, num_stages=3),
    )(x, y)


def main():
    backend, cfg = setup(
        "Pallas blocked matmul with k-axis accumulation",
        {
            "small": {"m": 512, "n": 512, "k": 512, "bm": 128, "bn": 128, "bk": 128},
            "large": {"m": 4096, "n": 4096, "k": 4096, "bm": 128, "bn": 128, "bk": 64},
        },
    )
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (cfg["m"], cfg["k"]), jnp.bfloat16)
    y = jax.random.normal(ky, (cfg["k"], cfg["n"]), jnp.bfloat16)
    # bf16 products are exact in f32, so only the summation order differs from the reference.
    expected = jnp.dot(x, y, preferred_element_type=jnp.float32)
    tol = 1e-6 * cfg["k"]

    variants = {
        "matmul": matmul,
        "matmul_k_loop": matmul_k_loop,
        "matmul_grouped": matmul_grouped,
        "matmul_persistent": matmul_persistent,
    }
    if not backend.interpret:
        del variants["matmul"]  # grid-axis accumulation needs sequential grid steps
        # The same kernel with its panels and result moved by Hopper's TMA (tensor descriptors):
        # one CompilerParams field, no change to the kernel (older GPUs: ordinary loads).
        variants["matmul_k_loop_tma"] = functools.partial(matmul_k_loop, use_tma=True)
    for name, impl in variants.items():
        blocks = {b: cfg[b] for b in ("bm", "bn", "bk")}
        fn = jax.jit(functools.partial(impl, **blocks, backend=backend))
        out = fn(x, y)
        ms = time_ms(fn, x, y, runs=cfg["runs"])
        check_and_report(name, out, expected, tol=tol, ms=ms, runs=cfg["runs"], backend=backend)


if __name__ == "__main__":
    main()
