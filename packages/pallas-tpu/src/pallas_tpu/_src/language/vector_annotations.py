"""TPU primitives with no value semantics: ``trace_value`` (profiler),
``touch`` (orders a Ref's effects), ``annotate`` (access assumptions for the
compiler) and ``with_memory_space_constraint`` (where ``pl.kernel`` places an
array). Conventions in ``vector_common.py``; ``pltpu`` imports them through
``vector_primitives.py``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Effect, Primitive
from jax.interpreters import ad, batching

from pallas.backend import constrain_memory_space
from pallas_tpu._src import compat
from pallas_tpu._src.language.vector_common import op_error, register_interpret

# -------------------------------------------------------------------- trace_value


class TraceEffect(Effect):
    """``trace_value`` writes to the profiler trace: keep it, in order."""

    __str__ = lambda self: "TpuTrace"  # noqa: E731


trace_effect = TraceEffect()
compat.allow_effect_in_kernels(TraceEffect)

trace_value_p = Primitive("trace_value")
trace_value_p.multiple_results = True


def trace_value(label: str, value: jax.Array) -> None:
    """Attaches a scalar to the enclosing xprof trace region (TPU profiler).

    Interpret mode has no profiler: the value is checked and dropped.

    Args:
      label: the name the value gets in the trace viewer.
      value: an int32 or float32 scalar.
    """
    value = jnp.asarray(value)
    if not isinstance(label, str):
        raise op_error(TypeError, "trace_value", f"label must be a str, got {type(label).__name__}")
    if value.shape != ():
        raise op_error(ValueError, "trace_value", f"value must be a scalar, got shape {value.shape}")
    if value.dtype not in (jnp.int32, jnp.float32):
        raise op_error(TypeError, "trace_value", f"value must be int32 or float32, got {value.dtype}")
    trace_value_p.bind(value, label=label)


@trace_value_p.def_effectful_abstract_eval
def _trace_value_abstract_eval(value, *, label):
    del value, label
    return [], {trace_effect}


def _trace_value_batch(args, dims, *, label):
    del dims
    # One trace entry per element would flood the trace; log the first lane.
    (value,) = args
    trace_value_p.bind(jnp.reshape(value, (-1,))[0], label=label)
    return [], []


batching.primitive_batchers[trace_value_p] = _trace_value_batch
register_interpret(trace_value_p, lambda value, *, label: [], multiple_results=True)


# -------------------------------------------------------------------------- touch

touch_p = Primitive("touch")
touch_p.multiple_results = True


def touch(ref) -> None:
    """Adds a fake read and write of ``ref``, so the compiler keeps
    operations on it ordered around this point (no value effect).

    Args:
      ref: a Ref, a sliced/transformed Ref, or a pytree of them.
    """
    for leaf in jax.tree.leaves(ref):
        if isinstance(leaf, compat.TransformedRef):
            leaf = leaf.ref
        if not isinstance(compat.typeof(leaf), compat.AbstractRef):
            raise op_error(TypeError, "touch", f"expects Refs, got {compat.typeof(leaf)}")
        touch_p.bind(leaf)


@touch_p.def_effectful_abstract_eval
def _touch_abstract_eval(ref):
    del ref
    return [], {compat.ReadEffect(0), compat.WriteEffect(0)}


def _touch_batch(args, dims):
    del dims
    touch_p.bind(*args)
    return [], []


def _touch_discharge(*args, **params):
    # (ctx, ref) in JAX 0.11+, (in_avals, out_avals, ref) before: nothing to do.
    del args, params
    return [None], []


batching.primitive_batchers[touch_p] = _touch_batch
compat.register_discharge_rule(touch_p)(_touch_discharge)
register_interpret(touch_p, lambda ref: [], multiple_results=True)


# ----------------------------------------------------------------------- annotate


def _memory_space_name(memory_space) -> str | None:
    if memory_space is None:
        return None
    inner = getattr(memory_space, "memory_space", memory_space)  # a per-core space
    return str(getattr(inner, "value", inner)).lower()


def annotate(
    ref: Any,
    *,
    no_store: bool = False,
    no_bank_conflict: bool = False,
    no_hazard: bool = False,
    no_hazard_no_deps: bool = False,
):
    """Declares access assumptions about a Ref for the TPU compiler.

    ``no_store``: nothing stores to the buffer (the compiler may reload
    instead of spilling); ``no_bank_conflict``: accesses never conflict;
    ``no_hazard``: read-after-write latency of 1 cycle (VMEM only);
    ``no_hazard_no_deps``: drop memory dependencies between loads and stores
    (VMEM only). ``no_bank_conflict`` combines with at most one other.

    The assumptions change scheduling, never values: interpret mode checks
    them and returns ``ref`` unchanged.

    Args:
      ref: a Ref or a sliced/transformed Ref.
      no_store, no_bank_conflict, no_hazard, no_hazard_no_deps: the
        assumptions.

    Returns:
      The Ref to use for the annotated accesses.
    """
    base = ref.ref if isinstance(ref, compat.TransformedRef) else ref
    aval = compat.typeof(base)
    if not isinstance(aval, compat.AbstractRef):
        raise op_error(TypeError, "annotate", f"ref must be a Ref, got {aval}")
    if sum((no_store, no_hazard, no_hazard_no_deps)) > 1:
        raise op_error(
            ValueError,
            "annotate",
            "no_store, no_hazard and no_hazard_no_deps exclude each other "
            "(only no_bank_conflict combines with one of them)",
        )
    space = _memory_space_name(getattr(aval, "memory_space", None))
    if (no_hazard or no_hazard_no_deps) and space not in (None, "vmem"):
        raise op_error(
            ValueError,
            "annotate",
            f"no_hazard and no_hazard_no_deps are only valid for VMEM Refs, this Ref is in {space}",
        )
    return ref


# --------------------------------------------------- with_memory_space_constraint

_CONSTRAINABLE_SPACES = ("hbm", "vmem", "smem", "host")

with_memory_space_constraint_p = Primitive("with_memory_space_constraint")


def with_memory_space_constraint(x: jax.Array, memory_space: Any) -> jax.Array:
    """Asks that array ``x`` be placed in ``memory_space`` when it is passed to
    ``pl.kernel``, which gives the body a Ref in that space (e.g. SMEM for scalars
    read with dynamic indices). The value is unchanged; other ops, ``pallas_call``
    and jit outputs ignore the request.

    Args:
      x: an array.
      memory_space: ``pl.ANY`` (no constraint), or HBM, VMEM, SMEM or HOST.

    Returns:
      ``x``, carrying the constraint.
    """
    name = _memory_space_name(memory_space)
    if name == "any":
        return x
    if name not in _CONSTRAINABLE_SPACES:
        raise op_error(
            NotImplementedError,
            "with_memory_space_constraint",
            f"only HBM, VMEM, SMEM and HOST are supported, got memory_space={memory_space}",
        )
    x = jnp.asarray(x)
    # The result's type stays a plain array; pl.kernel reads the request from this record.
    return constrain_memory_space(
        with_memory_space_constraint_p.bind(x, memory_space=memory_space), memory_space
    )


@with_memory_space_constraint_p.def_abstract_eval
def _wmsc_abstract_eval(x, *, memory_space):
    del memory_space
    return compat.ShapedArray(x.shape, x.dtype)


batching.defvectorized(with_memory_space_constraint_p)
ad.deflinear2(
    with_memory_space_constraint_p, lambda ct, x, **p: [with_memory_space_constraint_p.bind(ct, **p)]
)
register_interpret(with_memory_space_constraint_p, lambda x, *, memory_space: x)
