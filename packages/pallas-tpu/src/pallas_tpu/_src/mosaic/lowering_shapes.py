"""Mosaic rules for shapes: iota, broadcasts, reshapes, transposes, slices,
concatenate, tile, split, stack, unstack, pad, take_along_axis gathers
(``tpu.dynamic_gather``), roll and einshape; and the hints that change no value
(``pl.multiple_of``, memory-space constraints, ``trace_value``, ``touch``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src.language import vector_primitives as vp
from pallas_tpu._src.language.einshape import einshape_p
from pallas_tpu._src.mosaic.lowering import (
    Aval,
    aval_type,
    broadcast_to,
    constant,
    lower_fun,
    register_lowering,
    shape_cast,
)
from pallas_tpu._src.mosaic.lowering_math import convert

# ---------------------------------------------------------------------------
# Shapes


@register_lowering(lax.iota_p)
def _iota(ctx, *dyn, dtype, shape, dimension, **_):
    out = ctx.avals_out[0]
    if len(shape) == 1:
        # tpu.iota makes 2-D vectors: a (1, n) iota along its lanes, reshaped (as JAX's lowering does).
        x = tpu.iota(aval_type(Aval((1, *shape), np.int32)), [1])
        return convert(shape_cast(x, shape, np.int32), np.int32, out.dtype, shape)
    x = tpu.iota(aval_type(Aval(shape, np.int32)), [dimension])
    return convert(x, np.int32, out.dtype, shape)


@register_lowering(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *dyn, shape, broadcast_dimensions, **_):
    aval = ctx.avals_in[0]
    if not aval.shape:
        return broadcast_to(x, shape)
    # Insert the new axes as size-1 dims, then broadcast.
    keep = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        keep[dst] = aval.shape[src]
    return broadcast_to(shape_cast(x, keep, aval.dtype), shape)


@register_lowering(plb.broadcast_to_p)
def _state_broadcast_to(ctx, x, *, shape):
    # ``pl.broadcast_to`` (numpy broadcasting), through the broadcast_in_dim rule.
    return lower_fun(lambda v: jnp.broadcast_to(v, shape), ctx, x)


@register_lowering(lax.reshape_p, lax.squeeze_p)
def _reshape(ctx, x, *dyn, **_):
    out = ctx.avals_out[0]
    return shape_cast(x, out.shape, out.dtype)


@register_lowering(lax.transpose_p)
def _transpose(ctx, x, permutation):
    return tpu.transpose(aval_type(ctx.avals_out[0]), x, list(permutation))


@register_lowering(lax.slice_p)
def _slice(ctx, x, start_indices, limit_indices, strides):
    strides = strides or (1,) * len(start_indices)
    sizes = [(hi - lo + st - 1) // st for lo, hi, st in zip(start_indices, limit_indices, strides)]
    return vector.extract_strided_slice(
        aval_type(ctx.avals_out[0]), x, list(start_indices), sizes, list(strides)
    )


@register_lowering(lax.concatenate_p)
def _concatenate(ctx, *xs, dimension):
    return tpu.concatenate(list(xs), dimension)


@register_lowering(lax.tile_p)
def _tile(ctx, x, reps):
    for axis, n in enumerate(reps):
        if n > 1:
            x = tpu.concatenate([x] * n, axis)
    return x


@register_lowering(vp.bitcast_p)
def _tpu_bitcast(ctx, x, ty=None):
    return tpu.bitcast(aval_type(ctx.avals_out[0]), x)


# ---------------------------------------------------------------------------
# Shapes: split, stack, unstack, pad


@register_lowering(lax.split_p)
def _split(ctx, x, *, sizes, axis):
    aval = ctx.avals_in[0]
    starts, outs = [0] * len(aval.shape), []
    for size, out in zip(sizes, ctx.avals_out, strict=True):
        shape = list(aval.shape)
        shape[axis] = int(size)
        outs.append(vector.extract_strided_slice(aval_type(out), x, list(starts), shape, [1] * len(shape)))
        starts[axis] += int(size)
    return outs


@register_lowering(lax.stack_p)
def _stack(ctx, *xs, axis):
    aval = ctx.avals_in[0]
    shape = list(aval.shape)
    shape.insert(axis, 1)
    parts = [shape_cast(x, shape, aval.dtype) for x in xs]
    return parts[0] if len(parts) == 1 else tpu.concatenate(parts, axis)


@register_lowering(lax.unstack_p)
def _unstack(ctx, x, *, axis):
    aval = ctx.avals_in[0]
    size = list(aval.shape)
    size[axis] = 1
    out = ctx.avals_out[0]
    outs = []
    for i in range(aval.shape[axis]):
        starts = [0] * len(size)
        starts[axis] = i
        part = vector.extract_strided_slice(
            aval_type(Aval(size, aval.dtype)), x, starts, size, [1] * len(size)
        )
        outs.append(shape_cast(part, out.shape, out.dtype))
    return outs


@register_lowering(lax.pad_p)
def _pad(ctx, x, padding_value, *, padding_config):
    """Edge padding with a scalar: concatenated splats (as JAX; negative
    padding slices, interior padding is not supported)."""
    aval = ctx.avals_in[0]
    if not aval.shape:
        return x
    shape = list(aval.shape)
    for axis, (lo, hi, interior) in enumerate(padding_config):
        if interior:
            raise NotImplementedError("interior padding is not supported")
        if lo < 0 or hi < 0:
            start, stop = max(-lo, 0), shape[axis] - max(-hi, 0)
            sizes = list(shape)
            sizes[axis] = stop - start
            offsets = [0] * len(shape)
            offsets[axis] = start
            x = vector.extract_strided_slice(
                aval_type(Aval(sizes, aval.dtype)), x, offsets, sizes, [1] * len(shape)
            )
            shape = sizes
        parts = []
        for n in (max(lo, 0), None, max(hi, 0)):
            if n is None:
                parts.append(x)
            elif n:
                pad_shape = list(shape)
                pad_shape[axis] = n
                parts.append(broadcast_to(padding_value, pad_shape))
        if len(parts) > 1:
            x = tpu.concatenate(parts, axis)
            shape[axis] += max(lo, 0) + max(hi, 0)
    return x


@register_lowering(lax.gather_p)
def _gather(ctx, x, indices, *, dimension_numbers, slice_sizes, mode, **_):
    """``jnp.take_along_axis`` along one of the two minor dimensions:
    ``tpu.dynamic_gather`` (the only gather JAX's TPU lowering accepts)."""
    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    dn = dimension_numbers
    rank = len(out.shape)
    if not (
        len(aval.shape) == rank
        and ctx.avals_in[1].shape == (*out.shape, 1)
        and tuple(slice_sizes) == (1,) * rank
        and not dn.offset_dims
        and tuple(dn.collapsed_slice_dims) == tuple(dn.start_index_map)
        and len(dn.collapsed_slice_dims) == 1
        and tuple(dn.operand_batching_dims) == tuple(dn.start_indices_batching_dims)
        and len(dn.operand_batching_dims) == rank - 1
        and mode in (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    ):
        raise NotImplementedError("only take_along_axis-like gathers (jnp.take_along_axis) are supported")
    (axis,) = dn.collapsed_slice_dims
    if axis < rank - 2:
        raise NotImplementedError("gathers along one of the two minor dimensions only")
    idx = shape_cast(indices, out.shape, ctx.avals_in[1].dtype)
    return tpu.dynamic_gather(x, idx, [axis])


# ---------------------------------------------------------------------------
# Hints and TPU vector ops


@register_lowering(plb.multiple_of_p)
def _multiple_of(ctx, x, values):
    vals = values if isinstance(values, (tuple, list)) else (values,)
    if ctx.avals_in[0].shape or len(vals) != 1:
        return x
    return tpu.assume_multiple(x, int(vals[0]))


@register_lowering(einshape_p)
def _einshape(ctx, x, **params):
    # Its definition is a reshape, a transpose and a reshape: lowered through those rules.
    return lower_fun(einshape_p.impl, ctx, x, **params)


@register_lowering(vp.with_memory_space_constraint_p)
def _memory_space_constraint(ctx, x, **_):
    return x


@register_lowering(vp.trace_value_p)
def _trace_value(ctx, value, *, label):
    tpu.trace_value(value, label)
    return []


@register_lowering(vp.touch_p)
def _touch(ctx, *refs):
    return []


@register_lowering(vp.roll_p)
def _roll(ctx, x, shift, *, axis, stride=None, stride_axis=None, **_):
    shift = shift if isinstance(shift, ir.Value) else constant(shift, (), np.int32)
    return tpu.dynamic_rotate(x, shift, axis, stride=stride, stride_dimension=stride_axis)
