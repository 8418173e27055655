"""``run_mosaic``'s rules for the ops JAX 0.12 lowers its newest Pallas names
to: ``tpu.conv`` (``pltpu.conv``), ``tpu.memref_memory_space_is``
(``pltpu.has_memory_space``) and the MXU ops (``pltpu.matmul_*``; their state
is ``mxu_state.MxuState``, one per core: staging registers, weights, result FIFOs
and accumulators)."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax import lax

from pallas_tpu._src.executor import mxu_state
from pallas_tpu._src.executor.attrs import array_attr, bool_attr, enum_attr, int_attr
from pallas_tpu._src.executor.framework import rule
from pallas_tpu._src.executor.values import cast, memory_space, out_dtype

_DIMS = re.compile(r"\[([^\]]*)\]|(-?\d+)")


def conv_dimension_numbers(attr) -> lax.ConvDimensionNumbers:
    """A ``#tpu.conv_dimension_numbers<...>`` attribute (printed: the bindings have no
    class for it) as JAX's: lhs batch, feature, [spatial]; rhs input feature, output
    feature, [spatial]; out batch, feature, [spatial]."""
    body = str(attr)
    body = body[body.index("<") + 1 : body.rindex(">")]
    parts: list[Any] = [  # tuples for the spatial dims, ints for the others
        tuple(int(x) for x in m.group(1).split(",") if x.strip())
        if m.group(1) is not None
        else int(m.group(2))
        for m in _DIMS.finditer(body)
    ]
    lb, lf, ls, ri, ro, rs, ob, of, os_ = parts
    return lax.ConvDimensionNumbers((lb, lf, *ls), (ro, ri, *rs), (ob, of, *os_))


@rule("tpu.conv")
def _conv(ex, op, vals, env):
    from jaxlib.mlir import ir

    lhs, rhs, acc = (np.asarray(v) for v in vals)
    dn = conv_dimension_numbers(op.attributes["dimension_numbers"])
    reversal = [bool(x) for x in ir.DenseBoolArrayAttr(op.attributes["window_reversal"])]
    flip = [d for d, r in zip(dn.rhs_spec[2:], reversal) if r]
    if flip:
        rhs = np.flip(rhs, flip)
    pads = array_attr(op, "padding")
    kind = acc.dtype
    compute = np.float32 if kind.kind in "fV" else np.int32
    with jax.default_device(jax.devices("cpu")[0]):
        out = lax.conv_general_dilated(
            lhs,
            rhs,
            array_attr(op, "window_strides"),
            list(zip(pads[::2], pads[1::2])),
            array_attr(op, "lhs_dilation"),
            array_attr(op, "rhs_dilation"),
            dn,
            int_attr(op, "feature_group_count") if "feature_group_count" in op.attributes else 1,
            int_attr(op, "batch_group_count") if "batch_group_count" in op.attributes else 1,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=compute,
        )
    return [cast(acc.astype(compute) + np.asarray(out), op)]


@rule("tpu.memref_memory_space_is")
def _memref_memory_space_is(ex, op, vals, env):
    from jaxlib.mlir import ir

    placed = memory_space(ir.MemRefType(op.operands[0].type))
    asked = enum_attr(op.attributes["memory_space"])
    if placed == "any":  # run_mosaic keeps pl.ANY operands in HBM, as the interpreters do
        placed = "hbm"
    return [np.asarray(placed == asked).astype(out_dtype(op))]


# -- the MXU ops ---------------------------------------------------------------------


def _opt_int(op, name):
    return int_attr(op, name) if name in op.attributes else None


@rule("tpu.matmul_push_rhs")
def _matmul_push_rhs(ex, op, vals, env):
    rhs = np.asarray(vals[0]).astype(np.float32)
    if bool_attr(op, "transpose"):
        rhs = rhs.T
    reg = _opt_int(op, "staging_register") or 0
    mxu_state.of(ex).push(op, int_attr(op, "mxu_index"), reg, rhs)
    return []


@rule("tpu.matmul_acc_lhs")
def _matmul_acc_lhs(ex, op, vals, env):
    state, mxu = mxu_state.of(ex), int_attr(op, "mxu_index")
    out = state.multiply(op, mxu, np.asarray(vals[0]), _opt_int(op, "load_staged_rhs"))
    state.accumulate(mxu, int_attr(op, "acc"), out)
    return []


@rule("tpu.matmul_pop")
def _matmul_pop(ex, op, vals, env):
    from jaxlib.mlir import ir

    t = ir.VectorType(op.operation.results[0].type)
    out = mxu_state.of(ex).pop(int_attr(op, "mxu_index"), int_attr(op, "acc"), tuple(t.shape), out_dtype(op))
    return [out]


@rule("tpu.matmul_lhs_fifo")
def _matmul_lhs_fifo(ex, op, vals, env):
    state, mxu = mxu_state.of(ex), int_attr(op, "mxu_index")
    state.fifo_push(mxu, state.multiply(op, mxu, np.asarray(vals[0]), _opt_int(op, "load_staged_rhs")))
    return []


@rule("tpu.matmul_pop_fifo")
def _matmul_pop_fifo(ex, op, vals, env):
    from jaxlib.mlir import ir

    t = ir.VectorType(op.operation.results[0].type)
    return [mxu_state.of(ex).fifo_pop(op, int_attr(op, "mxu_index"), t.shape[0], out_dtype(op))]
