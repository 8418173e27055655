"""Layer norm and RMS norm over the last axis, forward and backward, as
row-block Pallas kernels (``layer_norm`` and ``rms_norm`` are thin APIs over
this module).

Each program normalizes ``block_rows`` whole rows, held in registers (the
feature count need not be a power of two: the lowering pads and masks it).
The forward pass also writes each row's mean and reciprocal standard
deviation for the backward pass. The backward kernel computes ``dx`` for its
rows and its partial sums of ``dy * x_hat`` and ``dy`` (the weight and bias
gradients), which XLA adds up over the programs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu._src.language.primitives import load as _gpu_load
from pallas_gpu._src.language.primitives import store as _gpu_store
from pallas_gpu.ops._common import call_params, next_power_of_2

_F32 = jnp.float32
_MAX_ROW = 1 << 16  # features per row held in registers (Triton's tensors stop at 2**20 elements)


def _launch(n_rows: int, n: int, num_warps: int | None):
    """(block_rows, num_warps): about 4096 elements per program, up to 16 rows."""
    width = next_power_of_2(n)
    block_rows = max(1, min(16, 4096 // width, next_power_of_2(n_rows)))
    warps = num_warps or min(16, max(1, block_rows * width // 512))
    return block_rows, warps


def forward_launch(rows: int, n: int, itemsize: int, num_warps=None, block_rows=None):
    """(block_rows, num_warps) of the forward kernel, for those left at None:
    about 4096 elements per program (whole rows, up to 16), a warp per 2 KiB
    of f32 or 4 KiB of 16-bit rows, at least 4 for 16-bit (on the H200 at 16384 x 8192, layer norm
    f32 ran 4.11 TB/s at 16 warps, 3.96 at 4; bf16 3.94 at 4 warps, 3.73 at
    16), up to 16 warps."""
    width = next_power_of_2(n)
    block_rows = block_rows or max(1, min(16, 4096 // width, next_power_of_2(rows)))
    if itemsize >= 4:
        warps = max(1, block_rows * width * itemsize // 2048)
    else:  # at least 4 (bf16 8192 a row: 2 warps ran 2.98 TB/s)
        warps = max(4, block_rows * width * itemsize // 4096)
    return block_rows, num_warps or min(16, warps)


def forward_evict(itemsize: int) -> str | None:
    """The forward kernel's default cache hint: ``evict_first`` for 16-bit
    rows (3.94 against 3.93 TB/s bf16 on the H200), none for f32 (equal)."""
    return "evict_first" if itemsize < 4 else None


def check_inputs(name: str, x, weight, bias) -> None:
    n = x.shape[-1] if x.ndim else 0
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have a feature axis (the last one); got shape {x.shape}")
    for arg, a in (("weight", weight), ("bias", bias)):
        if a.shape != (n,):
            raise ValueError(
                f"{name}: {arg} must have shape ({n},), the size of x's last axis; got {a.shape}"
            )
    if n > _MAX_ROW:
        raise ValueError(
            f"{name}: rows of {n} features do not fit in one program (at most {_MAX_ROW}); "
            "use backward_pass_impl='xla' and the reference, or split the feature axis"
        )


def _valid(block_rows: int, n_rows: int):
    rows = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    return rows < n_rows


def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, *, eps: float, center: bool, evict):
    x = _gpu_load(x_ref, eviction_policy=evict).astype(_F32)
    mean = jnp.mean(x, axis=1) if center else jnp.zeros(x.shape[:1], _F32)
    xc = x - mean[:, None]
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=1) + eps)
    y = xc * rstd[:, None] * w_ref[...].astype(_F32)[None, :] + b_ref[...].astype(_F32)[None, :]
    _gpu_store(y_ref, y.astype(y_ref.dtype), eviction_policy=evict)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(
    x_ref, w_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref, *, center: bool, n_rows: int
):
    block_rows = x_ref.shape[0]
    valid = _valid(block_rows, n_rows)  # the rows past the end of an edge block add nothing
    x = x_ref[...].astype(_F32)
    dy = jnp.where(valid, dy_ref[...].astype(_F32), 0.0)
    mean, rstd = mean_ref[...], rstd_ref[...]
    xhat = jnp.where(valid, (x - mean[:, None]) * rstd[:, None], 0.0)
    wdy = w_ref[...].astype(_F32)[None, :] * dy
    c1 = jnp.mean(xhat * wdy, axis=1)
    dx = wdy - xhat * c1[:, None]
    if center:
        dx = dx - jnp.mean(wdy, axis=1)[:, None]
    dx_ref[...] = (dx * rstd[:, None]).astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(dy * xhat, axis=0)
    db_ref[...] = jnp.sum(dy, axis=0)


def forward(x, weight, bias, *, eps, center, num_warps, num_stages, interpret, name, block_rows=None,
            evict="default"):  # fmt: skip
    """``y`` and the residuals ``(x, weight, bias, mean, rstd)``; ``block_rows``
    and ``num_warps`` at None take ``forward_launch``'s choice, ``evict`` is
    the cache hint of the loads of ``x`` and stores of ``y`` (``"default"``:
    ``forward_evict``'s choice)."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    block_rows, warps = forward_launch(rows, n, x.dtype.itemsize, num_warps, block_rows)
    evict = forward_evict(x.dtype.itemsize) if evict == "default" else evict
    row_spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((n,), lambda i: (0,))
    stat_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
    y, mean, rstd = pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, center=center, evict=evict),
        out_shape=[x2, jax.ShapeDtypeStruct((rows,), _F32), jax.ShapeDtypeStruct((rows,), _F32)],
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[row_spec, vec_spec, vec_spec],
        out_specs=[row_spec, stat_spec, stat_spec],
        name=f"{name}_forward",
        **call_params(interpret, warps, num_stages),
    )(x2, weight, bias)
    return y.reshape(shape), (x, weight, bias, mean, rstd)


def backward(res, dy, *, center, num_warps, num_stages, interpret, name):
    x, weight, bias, mean, rstd = res
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    rows = x2.shape[0]
    block_rows, warps = _launch(rows, n, num_warps)
    programs = pl.cdiv(rows, block_rows)
    row_spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((n,), lambda i: (0,))
    stat_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
    partial_spec = pl.BlockSpec((None, n), lambda i: (i, 0))
    partial = jax.ShapeDtypeStruct((programs, n), _F32)
    dx, dw, db = pl.pallas_call(
        functools.partial(_bwd_kernel, center=center, n_rows=rows),
        out_shape=[x2, partial, partial],
        grid=(programs,),
        in_specs=[row_spec, vec_spec, row_spec, stat_spec, stat_spec],
        out_specs=[row_spec, partial_spec, partial_spec],
        name=f"{name}_backward",
        **call_params(interpret, warps, num_stages),
    )(x2, weight, dy2, mean, rstd)
    dw = jnp.sum(dw, axis=0).astype(weight.dtype)
    db = jnp.sum(db, axis=0).astype(bias.dtype)
    return dx.reshape(x.shape), dw, db


def reference(x, weight, bias, eps: float, center: bool):
    """Plain JAX, in f32, over the last axis."""
    xf = x.astype(_F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True) if center else 0.0
    xc = xf - mean
    y = xc * lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(_F32) + bias.astype(_F32)).astype(x.dtype)


def make(name: str, center: bool, doc: str, primal=None, module: str | None = None):
    """The public ``name(x, weight, bias, num_warps, num_stages, eps,
    backward_pass_impl, interpret)`` with its custom VJP; its value undifferentiated
    is ``primal`` of the same arguments where given (else the forward kernel's), and
    its ``__module__`` ``module`` where given."""

    def impl(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret):
        check_inputs(name, x, weight, bias)
        if backward_pass_impl not in ("triton", "xla"):
            raise ValueError(
                f"{name}: backward_pass_impl must be 'triton' or 'xla', got {backward_pass_impl!r}"
            )
        return forward(x, weight, bias, eps=eps, center=center, num_warps=num_warps, num_stages=num_stages,
                       interpret=interpret, name=name)  # fmt: skip

    def fn(
        x,
        weight,
        bias,
        num_warps: int | None = None,
        num_stages: int | None = 3,
        eps: float = 1e-5,
        backward_pass_impl: str = "triton",
        interpret: Any = False,
    ):
        if primal is not None:
            return primal(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret)
        return impl(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret)[0]

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    if module is not None:
        fn.__module__ = module

    def fwd(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret):
        return impl(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret)

    def bwd(num_warps, num_stages, eps, backward_pass_impl, interpret, res, dy):
        if backward_pass_impl == "xla":
            x, weight, bias = res[:3]
            _, vjp = jax.vjp(functools.partial(reference, eps=eps, center=center), x, weight, bias)
            return vjp(dy)
        return backward(res, dy, center=center, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                        name=name)  # fmt: skip

    static = ["num_warps", "num_stages", "eps", "backward_pass_impl", "interpret"]
    public = jax.custom_vjp(jax.jit(fn, static_argnames=static), nondiff_argnums=(3, 4, 5, 6, 7))
    public.defvjp(fwd, bwd)
    return public
