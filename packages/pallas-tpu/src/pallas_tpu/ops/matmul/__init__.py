"""Blocked matrix multiplication ``x @ y`` on the TensorCore, with the call
signature of JAX's ``ops.tpu.matmul``.

The grid is (row blocks, column blocks, k steps): one program owns a
``(bm, bn)`` tile of the result and walks ``k`` in steps of ``bk``, feeding the
two panels to the MXU in their own dtype (bf16 and int8 straight in, fp8 where
the chip's MXU takes it, else widened to bf16 in VMEM) and accumulating in 32
bits (f32, or int32 for integer inputs). The tile is written once, on the last
k step: a 32-bit result accumulates in the output block itself (it stays in
VMEM while k runs), a narrower one in an f32 VMEM scratch that is converted
on the way out; the first k step stores its product as it is (no zeroing pass),
and a single k step writes the result straight out. The k axis is ``"arbitrary"``, the other two ``"parallel"``
(split over the TensorCores of a megacore chip).

Blocks come from ``choose_blocks`` when not given: the rows measured on the
TPU v5e (``ops._policy``), else a rule from the chip's facts: tiles square
enough that the MXU, not HBM, sets the pace, shrunk until the double-buffered
panels fit the VMEM budget. A product of at most 256 rows (a decode projection,
bound by HBM bringing ``y`` in) on a one-core chip takes whole rows of ``y`` as its
panels instead, about 4 MiB each. Given blocks are used as they are, and must divide
the operands. The VMEM limit is raised to what the blocks need.

The modules (the skeleton of every family, ``pallas_tpu.ops``' docstring): this one
the API, ``_kernel`` the kernel bodies and their ``pallas_call``, ``_blocks`` the
block choice; the reference is ``jnp.dot``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.matmul import _kernel
from pallas_tpu.ops.matmul._blocks import LANE
from pallas_tpu.ops.matmul._blocks import choose_blocks as choose_blocks
from pallas_tpu.ops.matmul._blocks import vmem_bytes as vmem_bytes
from pallas_tpu.ops.matmul._kernel import accumulator_dtype as accumulator_dtype
from pallas_tpu.ops.matmul._kernel import matmul_kernel as matmul_kernel


def _check_block(name: str, block: int, dim: int, what: str, align: int) -> None:
    if not isinstance(block, (int, np.integer)) or block <= 0:
        raise ValueError(f"matmul: {name} must be a positive int, got {block!r}")
    if dim % block:
        raise ValueError(
            f"matmul: {name}={block} does not divide {what}={dim}; pick a block that divides it "
            f"(or leave the blocks out: matmul chooses and pads)"
        )
    if block != dim and block % align:
        raise ValueError(
            f"matmul: {name}={block} must be a multiple of {align} (the TPU's tile) or all of {what}={dim}"
        )


def _check(x, y, out_dtype, block_shape, block_k) -> np.dtype:
    """The output dtype, once the operands and given blocks are checked."""
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"matmul: x and y must be 2-d, got x{list(x.shape)} and y{list(y.shape)}")
    (m, k), (k2, n) = x.shape, y.shape
    if k != k2:
        raise ValueError(f"matmul: x{list(x.shape)} @ y{list(y.shape)}: x.shape[1]={k} != y.shape[0]={k2}")
    if out_dtype is None:
        if x.dtype != y.dtype:
            raise TypeError(
                f"matmul: cannot deduce the output dtype of {x.dtype} @ {y.dtype}: pass out_dtype"
            )
        out_dtype = x.dtype
    for name, dtype in (("x", x.dtype), ("y", y.dtype)):
        if jnp.issubdtype(dtype, jnp.unsignedinteger) or not jnp.issubdtype(dtype, jnp.number):
            raise ValueError(f"matmul: {name} is {dtype}; take float32, bfloat16, fp8 or signed integers")
    if block_shape is not None:
        if len(block_shape) != 2:
            raise ValueError(f"matmul: block_shape must be (bm, bn), got {block_shape!r}")
        _check_block("block_shape[0]", block_shape[0], m, "x.shape[0]", 8)
        _check_block("block_shape[1]", block_shape[1], n, "y.shape[1]", LANE)
    if block_k is not None:
        _check_block("block_k", block_k, k, "x.shape[1]", LANE)
    return np.dtype(out_dtype)


def _blocks(m, k, n, in_dtype, out_dtype, block_shape, block_k, info) -> tuple[int, int, int]:
    """``(bm, bn, bk)``: those given, the others chosen (``choose_blocks``)."""
    chosen_m, chosen_k, chosen_n = choose_blocks(m, k, n, in_dtype, out_dtype, info)
    bm, bn = block_shape if block_shape is not None else (chosen_m, chosen_n)
    if block_k is not None:
        return bm, bn, block_k
    return bm, bn, chosen_k if block_shape is None else (_policy.fit_block(k, chosen_k) or chosen_k)


@functools.partial(jax.jit, static_argnames=["block_shape", "block_k", "out_dtype", "debug", "interpret"])
def matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    block_shape: tuple[int, int] | None = None,
    block_k: int | None = None,
    out_dtype: jax.typing.DTypeLike | None = None,
    debug: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """``x @ y`` as a blocked Pallas TPU kernel.

    Args:
      x: ``(m, k)``: float32, bfloat16, int8 (int32 accumulation) or an fp8 type.
      y: ``(k, n)``, the same dtype as ``x`` unless ``out_dtype`` is given.
      block_shape: ``(bm, bn)``, the output tile; None (JAX's op requires it): chosen
        (``choose_blocks``).
      block_k: the k step; None (JAX's op defaults to 256): chosen with the tile
        (``choose_blocks``; on a TPU v5e 1024 for 16-bit inputs).
      out_dtype: the result's dtype; default ``x``'s dtype (as JAX's op).
      debug: print the kernel's jaxpr and grid mapping.
      interpret: run the kernel in Pallas' interpret mode (any machine).

    Returns:
      ``(m, n)`` in ``out_dtype``; zeros when ``k`` is 0 (an empty sum), an empty array
      when ``m`` or ``n`` is 0 (no kernel runs).

    Raises:
      ValueError: ``x``/``y`` are not matrices with matching k, or a given
        block does not divide its dimension.
      TypeError: the dtypes differ and ``out_dtype`` is None.
    """
    out_dtype = _check(x, y, out_dtype, block_shape, block_k)
    (m, k), n = x.shape, y.shape[1]
    if 0 in (m, k, n):  # an empty sum is 0: no kernel to run
        return jnp.zeros((m, n), out_dtype)
    info = pltpu.get_tpu_info()
    in_dtype = x.dtype if x.dtype.itemsize >= y.dtype.itemsize else y.dtype
    acc_dtype = accumulator_dtype(in_dtype)
    if jnp.issubdtype(x.dtype, jnp.integer) != jnp.issubdtype(y.dtype, jnp.integer):
        acc_dtype = np.dtype(np.float32)
    blocks = _blocks(m, k, n, in_dtype, out_dtype, block_shape, block_k, info)
    return _kernel.call(x, y, blocks, in_dtype, acc_dtype, out_dtype, info, debug=debug, interpret=interpret)
