"""Vector add with a @triton.jit kernel through jax_triton.triton_call.

Runs on a CUDA GPU through jax-kernel-runtime, or on the CPU through Triton's
interpreter (no GPU needed): `python examples/triton_add.py`.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import jax_triton as jt


@triton.jit
def add_kernel(x_ptr, y_ptr, length, output_ptr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < length
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(output_ptr + offsets, x + y, mask=mask)


def add(x: jax.Array, y: jax.Array, block_size: int = 1024) -> jax.Array:
    return jt.triton_call(
        x,
        y,
        x.size,
        kernel=add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=lambda meta: (jt.cdiv(x.size, meta["BLOCK_SIZE"]),),
        BLOCK_SIZE=block_size,
    )


def main(n: int = 10_000) -> None:
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n,), jnp.float32)
    y = jax.random.normal(ky, (n,), jnp.float32)
    out = jax.jit(add)(x, y)
    err = float(jnp.max(jnp.abs(out - (x + y))))
    status = "PASS" if err == 0.0 else "FAIL"
    print(f"triton_add: {status}  max_abs_err={err:.1e} (tol 0)  backend={jax.default_backend()}")
    if status != "PASS":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
