"""RMS norm over the last axis, forward and backward, with the API of JAX's
Pallas GPU op ``rms_norm`` (``rms_norm``,
``rms_norm_reference``; like JAX's, it takes a bias).

The forward pass is memory bound: it must read ``x`` once and write ``y``
once. Called without differentiation, ``rms_norm`` runs a single-pass kernel
that holds its rows whole in registers (one row per program for rows of
4096 elements or more, a few short rows per program otherwise), loads and
stores them with the ``evict_first`` cache hint (streamed data that will not
be read again should not push ``weight`` and ``bias``, which every program
reads, out of L2), and writes nothing else. Under ``jax.vjp``/``jax.grad``
the forward kernel of ``layer_norm`` (without centering) runs instead: it
also saves each row's reciprocal standard deviation for the backward kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu._src.language.primitives import load as _gpu_load
from pallas_gpu._src.language.primitives import store as _gpu_store
from pallas_gpu.ops import _norm
from pallas_gpu.ops._common import call_params, next_power_of_2

_F32 = jnp.float32
_ROW_ELEMENTS = 4096  # elements per program below which short rows are batched together


def forward_launch(rows: int, n: int, itemsize: int, num_warps=None, block_rows=None) -> tuple[int, int]:
    """(rows per program, warps) of the single-pass forward kernel, for those
    left at None: at least ``_ROW_ELEMENTS`` elements per program (whole
    rows), and a warp per 2 KiB of the block up to 16 warps (16 bytes of
    ``x`` a thread per 512 threads: one or a few 16-byte loads)."""
    width = next_power_of_2(n)
    block_rows = block_rows or max(1, min(16, _ROW_ELEMENTS // width, next_power_of_2(rows)))
    warps = num_warps or min(16, max(1, block_rows * width * max(itemsize, 2) // 2048))
    return block_rows, warps


def _forward_kernel(x_ref, w_ref, b_ref, y_ref, *, eps: float, evict: str | None):
    x = _gpu_load(x_ref, eviction_policy=evict).astype(_F32)
    rstd = lax.rsqrt(jnp.mean(x * x, axis=1) + eps)
    y = x * rstd[:, None] * w_ref[...].astype(_F32)[None, :] + b_ref[...].astype(_F32)[None, :]
    _gpu_store(y_ref, y.astype(y_ref.dtype), eviction_policy=evict)


def forward(x, weight, bias, *, eps=1e-5, block_rows=None, num_warps=None, evict="evict_first", interpret=False,
            debug=False):  # fmt: skip
    """``rms_norm``'s forward value only (no residuals): one pass over ``x``.
    ``block_rows`` and ``num_warps`` default to ``forward_launch``'s choice;
    ``evict`` is the cache hint of the loads and stores of ``x`` and ``y``
    (``"evict_first"``, ``"evict_last"`` or None)."""
    _norm.check_inputs("rms_norm", x, weight, bias)
    if evict not in (None, "evict_first", "evict_last"):
        raise ValueError(
            f"rms_norm forward: evict must be 'evict_first', 'evict_last' or None; got {evict!r}"
        )
    if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"rms_norm forward: block_rows must be a positive int or None; got {block_rows!r}")
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    block_rows, warps = forward_launch(rows, n, x.dtype.itemsize, num_warps, block_rows)
    row_spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((n,), lambda i: (0,))
    y = pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, evict=evict),
        out_shape=x2,
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[row_spec, vec_spec, vec_spec],
        out_specs=row_spec,
        name="rms_norm_forward",
        debug=debug,
        **call_params(interpret, warps, 1),
    )(x2, weight, bias)
    return y.reshape(shape)


def _primal(x, weight, bias, num_warps, num_stages, eps, backward_pass_impl, interpret):
    del num_stages  # no loop to pipeline: a row is loaded whole
    if backward_pass_impl not in ("triton", "xla"):
        raise ValueError(
            f"rms_norm: backward_pass_impl must be 'triton' or 'xla', got {backward_pass_impl!r}"
        )
    return forward(x, weight, bias, eps=eps, num_warps=num_warps, interpret=interpret)


rms_norm = _norm.make(
    "rms_norm",
    center=False,
    doc="""``x / sqrt(mean(x**2) + eps) * weight + bias`` over the last axis of
    ``x`` (any leading shape), differentiable in x, weight and bias; the
    other arguments as in ``layer_norm``. Without differentiation, a
    single-pass kernel (read x, write y, nothing else).""",
    primal=_primal,
    module=__name__,
)


@functools.partial(jax.jit, static_argnames=["eps"])
def rms_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    """Plain-JAX RMS norm (computed in f32)."""
    return _norm.reference(x, weight, bias, eps=eps, center=False)
