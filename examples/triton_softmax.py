"""Fused row softmax (one program per row) through jax_triton.triton_call.

Runs on a CUDA GPU, or on the CPU through Triton's interpreter.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import jax_triton as jt


@triton.jit
def softmax_kernel(x_ptr, n_cols, out_ptr, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    # int64 row offset: rows * cols can exceed 2**31 elements.
    offset = row.to(tl.int64) * n_cols
    x = tl.load(x_ptr + offset + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    num = tl.exp(x)
    out = num / tl.sum(num, axis=0)
    tl.store(out_ptr + offset + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: jax.Array) -> jax.Array:
    rows, cols = x.shape
    block = jt.next_power_of_2(cols)
    return jt.triton_call(
        x,
        cols,
        kernel=softmax_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        num_warps=8 if block >= 2048 else 4,
        BLOCK_SIZE=block,
    )


def main(rows: int = 64, cols: int = 300) -> None:
    x = jax.random.normal(jax.random.key(1), (rows, cols), jnp.float32) * 4
    out = jax.jit(softmax)(x)
    err = float(jnp.max(jnp.abs(out - jax.nn.softmax(x, axis=-1))))
    status = "PASS" if err < 1e-6 else "FAIL"
    print(f"triton_softmax: {status}  max_abs_err={err:.1e} (tol 1e-6)  backend={jax.default_backend()}")
    if status != "PASS":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
