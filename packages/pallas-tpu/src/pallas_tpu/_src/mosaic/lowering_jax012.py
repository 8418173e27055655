"""Rules for the names JAX 0.12 added to Pallas: ``pltpu.has_memory_space``,
``pltpu.request_p_state`` (JAX 0.12.1), the poison that
``pl.enable_poison_buffers`` stores into ``pl.run_scoped`` buffers, and
(``lowering_mxu.py``) ``pltpu.conv`` and the MXU ops.

Each emits the Mosaic op JAX 0.12's lowering emits. An op that jaxlib's Mosaic
dialect lacks on an older JAX is refused with ``needs_jax``'s message, which
names the JAX release that has it.
"""

from __future__ import annotations

import numpy as np
from jaxlib import version as jaxlib_version
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import memref, scf, vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src.language import memory_query, tpu_info
from pallas_tpu._src.language import primitives as tpu_prims
from pallas_tpu._src.mosaic.lowering import (
    constant,
    index,
    is_bool,
    memory_space_attr,
    register_lowering,
)


def needs_jax(what: str, version: str) -> NotImplementedError:
    """The error for a Mosaic op that this jaxlib's dialect does not have."""
    return NotImplementedError(
        f"{what} needs Mosaic's support from JAX/jaxlib >= {version}; this is jaxlib "
        f"{jaxlib_version.__version__}: upgrade JAX, or run the kernel with "
        "interpret=pltpu.InterpretParams()"
    )


@register_lowering(memory_query.has_memory_space_p)
def _has_memory_space(ctx, ref, *, memory_space):
    if not hasattr(tpu, "memref_memory_space_is"):
        raise needs_jax("pltpu.has_memory_space (tpu.memref_memory_space_is)", "0.12")
    return tpu.memref_memory_space_is(ref, memory_space_attr(memory_space))


def store_poison(ref: ir.Value, aval) -> None:
    """Fills a fresh scratch buffer with ``pl.enable_poison_buffers``' poison:
    one vector store in VMEM (as JAX), element by element in SMEM (scalars only)."""
    space = str(ir.MemRefType(ref.type).memory_space)
    if "hbm" in space or "any" in space:  # JAX poisons on-chip scratch only
        return
    shape = tuple(aval.shape)
    value = np.int32(1) if is_bool(aval.dtype) else plb.poison_value(aval.dtype)  # bool Refs hold i32 0/1
    dtype, item = value.dtype, value.item()
    if "smem" not in space:
        vector.store(constant(item, shape, dtype), ref, [index(0) for _ in shape])
        return
    scalar = constant(item, (), dtype)
    if not shape:
        memref.store(scalar, ref, [])
        return
    _store_everywhere(scalar, ref, shape, [])


def _store_everywhere(scalar, ref, shape, at) -> None:
    """``ref[i, j, ...] = scalar`` for every index, in nested ``scf.for`` loops."""
    # jaxlib's scf.ForOp(lower, upper, step) wrapper; the stubs give the generated op's signature.
    loop = scf.ForOp(index(0), index(shape[len(at)]), index(1))  # type: ignore[call-arg, arg-type]
    with ir.InsertionPoint(loop.body):
        i = loop.induction_variable
        if len(at) + 1 == len(shape):
            memref.store(scalar, ref, [*at, i])
        else:
            _store_everywhere(scalar, ref, shape, [*at, i])
        scf.yield_([])


@register_lowering(tpu_prims.request_p_state_p)
def _request_p_state(ctx, *, p_state):
    """``tpu.request_p_state``: TPU7x and later only (JAX's words first), in jaxlib's
    Mosaic dialect from JAX 0.12.1."""
    info = tpu_info.get_tpu_info()
    if info.generation < 7:
        raise NotImplementedError(
            f"request_p_state is only supported on TPU7x+: pltpu.request_p_state asks a TensorCore for a "
            f"P-state, which TPU v{info.generation} chips do not take; leave it out of kernels for this chip "
            "(their clock follows the firmware's choice)"
        )
    if not hasattr(tpu, "RequestPStateOp"):
        raise needs_jax("pltpu.request_p_state (tpu.request_p_state)", "0.12.1")
    tpu.request_p_state(p_state)
    return []
