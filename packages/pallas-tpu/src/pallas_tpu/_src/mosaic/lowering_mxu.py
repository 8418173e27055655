"""Rules for JAX 0.12's MXU-level ops: ``pltpu.conv`` (``tpu.conv``) and the
MXU FIFO ops (``tpu.matmul_push_rhs``, ``tpu.matmul_acc_lhs``,
``tpu.matmul_pop``, ``tpu.matmul_lhs_fifo``, ``tpu.matmul_pop_fifo``), with
the attributes JAX 0.12's lowering gives them.

An ``ACC`` Ref is no memref: it names a slice of one MXU's accumulator
memory, an ``AccRef`` (its first entry, in vregs from the start of that MXU's
accumulators, as JAX numbers them) that the ops take as an attribute.
``pl.run_scoped`` and scratch ``ACC`` buffers are given consecutive entries
per MXU, in the order the kernel allocates them.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

from pallas_tpu._src.language import conv as tpu_conv
from pallas_tpu._src.language import mxu as tpu_mxu
from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.mosaic.lowering import (
    LoweringException,
    aval_type,
    constant,
    register_lowering,
    value_type,
)
from pallas_tpu._src.mosaic.lowering_jax012 import needs_jax


def conv_dimension_numbers_attr(dn) -> ir.Attribute:
    """``#tpu.conv_dimension_numbers<...>`` of a ``lax.ConvDimensionNumbers``: lhs batch,
    feature and spatial dims, rhs input and output feature and spatial dims, out's."""

    def dims(ds):
        return "[" + ", ".join(map(str, ds)) + "]"

    lhs, rhs, out = dn
    return ir.Attribute.parse(
        f"#tpu.conv_dimension_numbers<{lhs[0]}, {lhs[1]}, {dims(lhs[2:])}, {rhs[1]}, {rhs[0]}, "
        f"{dims(rhs[2:])}, {out[0]}, {out[1]}, {dims(out[2:])}>"
    )


def _precision_attr(precision):
    if isinstance(precision, tuple):
        if precision[0] != precision[1]:
            raise NotImplementedError("pltpu.conv: one precision per operand is not supported; give one")
        precision = precision[0]
    if precision is None or precision == lax.Precision.DEFAULT:
        return None
    if precision == lax.Precision.HIGHEST:
        return ir.Attribute.parse("#tpu.contract_precision<fp32>")
    raise NotImplementedError(
        f"pltpu.conv: precision {precision} has no Mosaic equivalent (DEFAULT or HIGHEST)"
    )


@register_lowering(tpu_conv.conv_p)
def _conv(
    ctx,
    *args,
    dimension_numbers,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    window_reversal,
    feature_group_count,
    batch_group_count,
    precision,
    preferred_element_type,
):
    if not hasattr(tpu, "ConvOp"):
        raise needs_jax("pltpu.conv (tpu.conv)", "0.11.2")
    for aval in ctx.avals_in[:2]:
        if jnp.issubdtype(aval.dtype, jnp.unsignedinteger):
            raise NotImplementedError(
                f"pltpu.conv: unsigned {aval.dtype} operands have no Mosaic convolution"
            )
    out = ctx.avals_out[0]
    out_t = aval_type(out)
    # No accumulator: a zero one, as JAX's lowering makes.
    acc = args[2] if len(args) > 2 else constant(0, out.shape, out.dtype)
    return tpu.ConvOp(
        out_t,
        args[0],
        args[1],
        acc,
        window_strides=list(window_strides),
        padding=[p for pair in padding for p in pair],
        lhs_dilation=list(lhs_dilation),
        rhs_dilation=list(rhs_dilation),
        window_reversal=list(window_reversal),
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=_precision_attr(precision),
        dimension_numbers=conv_dimension_numbers_attr(dimension_numbers),
    ).result


# ---------------------------------------------------------------------------
# The MXU ops


@dataclasses.dataclass(frozen=True)
class AccRef:
    """An ``ACC`` Ref in the lowering: entries of MXU ``mxu_id``'s accumulators from
    ``base_address`` (in vregs, as Mosaic's ops take it)."""

    base_address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    mxu_id: int
    entries: int  # (sublanes x MXU width) entries it takes


def alloc_accumulator(kernel, aval) -> AccRef:
    """The next free entries of the MXU's accumulators for a ``pl.run_scoped`` ACC Ref
    (``free_accumulators`` gives them back when the scope ends)."""
    info = tpu_info.get_tpu_info()
    space = aval.memory_space
    tpu_mxu.check_accumulator_ref(tuple(aval.shape), aval.dtype, space.mxu_id)
    offsets = kernel.acc_offsets
    base = offsets.get(space.mxu_id, 0)
    entries = math.prod(aval.shape[:-1]) // info.num_sublanes
    if base + entries > info.num_accumulators:
        raise LoweringException(
            f"{kernel.describe()}: pltpu.ACC({space.mxu_id}){list(aval.shape)} needs {entries} accumulator "
            f"entries of MXU {space.mxu_id}, but only {info.num_accumulators - base} of its "
            f"{info.num_accumulators} are free (scopes that hold the others are still open)"
        )
    offsets[space.mxu_id] = base + entries
    vregs_per_entry = info.mxu_column_size // info.num_lanes
    return AccRef(base * vregs_per_entry, tuple(aval.shape), np.dtype(aval.dtype), space.mxu_id, entries)


def free_accumulators(kernel, refs) -> None:
    for ref in reversed(refs):
        if isinstance(ref, AccRef):
            kernel.acc_offsets[ref.mxu_id] -= ref.entries


def _needs(op: str, version: str, what: str):
    if not hasattr(tpu, op):
        raise needs_jax(f"{what} (tpu.{op})", version)


def _acc(ctx, acc, op: str) -> AccRef:
    if not isinstance(acc, AccRef):
        raise LoweringException(
            f"{ctx.kernel.describe()}: {op} takes an accumulator Ref of pl.run_scoped(pltpu.ACC(...)); "
            "ACC scratch_shapes and operands have no Mosaic form"
        )
    return acc


@register_lowering(tpu_mxu.matmul_push_rhs_p)
def _matmul_push_rhs(ctx, rhs, *, staging_register, mxu_index, transpose):
    _needs("matmul_push_rhs", "0.10.2", "pltpu.matmul_push_rhs")
    tpu.matmul_push_rhs(rhs, mxu_index, staging_register=staging_register, transpose=transpose)
    return []


@register_lowering(tpu_mxu.matmul_acc_lhs_p)
def _matmul_acc_lhs(ctx, acc, lhs, *, load_staged_rhs):
    _needs("matmul_acc_lhs", "0.10.2", "pltpu.matmul_acc_lhs")
    acc = _acc(ctx, acc, "pltpu.matmul_acc_lhs")
    kw = {} if load_staged_rhs is None else {"load_staged_rhs": load_staged_rhs}
    tpu.matmul_acc_lhs(acc.base_address, lhs, acc.mxu_id, **kw)
    return []


@register_lowering(tpu_mxu.matmul_pop_p)
def _matmul_pop(ctx, acc):
    _needs("matmul_pop", "0.10.2", "pltpu.matmul_pop")
    acc = _acc(ctx, acc, "pltpu.matmul_pop")
    return tpu.matmul_pop(value_type(acc.shape, acc.dtype), acc.base_address, acc.mxu_id)


@register_lowering(tpu_mxu.matmul_lhs_fifo_p)
def _matmul_lhs_fifo(ctx, lhs, *, mxu_index, load_staged_rhs):
    _needs("matmul_lhs_fifo", "0.11.2", "pltpu.matmul_lhs_fifo")
    tpu.matmul_lhs_fifo(lhs, mxu_index, load_staged_rhs=load_staged_rhs)
    return []


@register_lowering(tpu_mxu.matmul_pop_fifo_p)
def _matmul_pop_fifo(ctx, *, shape, dtype, mxu_index):
    _needs("matmul_pop_fifo", "0.11.2", "pltpu.matmul_pop_fifo")
    return tpu.matmul_pop_fifo(value_type(shape, dtype), mxu_index)
