"""GPU-only kernel primitives: masked ``load``/``store``, atomics and ``dot``.

Each primitive is bound on a Ref plus the flattened NDIndexer transforms
(like JAX's ``get_p``), so the lowering computes the same pointer + mask as
for plain Ref indexing and adds the user's mask on top.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax, tree_util
from jax.extend.core import Primitive

from pallas_gpu._src import compat


def _indexer(ref: Any, idx: Any):
    """(underlying Ref, transforms) for ``ref.at[...]``/``idx`` (default: all)."""
    transforms: tuple = ()
    if isinstance(ref, compat.TransformedRef):
        transforms = tuple(ref.transforms)
        ref = ref.ref
    shape = _view_shape(ref, transforms)
    if idx is None:
        idx = tuple(slice(None) for _ in shape)
    if not isinstance(idx, tuple):
        idx = (idx,)
    indexer = compat.NDIndexer.from_indices_shape(idx, shape)
    return ref, (*transforms, indexer)


def _view_shape(ref, transforms):
    shape = tuple(ref.shape)
    for t in transforms:
        shape = t.get_indexer_shape() if hasattr(t, "get_indexer_shape") else t.transform_shape(shape)
    return shape


def _ref_shape_after(ref_aval, transforms):
    shape = tuple(ref_aval.shape)
    for t in transforms:
        shape = t.get_indexer_shape()
    return shape


# ---------------------------------------------------------------------------
# load / store

load_p = Primitive("plgpu_load")
store_p = Primitive("plgpu_store")
store_p.multiple_results = True


def load(
    ref: Any,
    idx: Any = None,
    *,
    mask: Any = None,
    other: Any = None,
    cache_modifier: str | None = None,
    eviction_policy: str | None = None,
    volatile: bool = False,
) -> jax.Array:
    """Loads ``ref[idx]`` where ``mask`` is true, ``other`` elsewhere.

    Args:
      ref: a Ref (or ``ref.at[...]`` view).
      idx: an index into it (ints, slices, ``pl.ds``); default the whole Ref.
      mask: a boolean array of the result's shape; masked-off elements are
        not read from memory.
      other: the value of masked-off elements (scalar or array; default 0).
      cache_modifier, eviction_policy, volatile: Triton's load hints.
    Returns:
      The loaded array.
    """
    ref, transforms = _indexer(ref, idx)
    flat, tree = tree_util.tree_flatten(transforms)
    shape = _ref_shape_after(ref, transforms)
    dtype = ref.dtype
    args = [ref, *flat]
    has_mask, has_other = mask is not None, other is not None
    if has_mask:
        args.append(jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), shape))
    if has_other:
        args.append(jnp.broadcast_to(jnp.asarray(other, dtype), shape))
    return load_p.bind(
        *args,
        tree=tree,
        has_mask=has_mask,
        has_other=has_other,
        cache_modifier=cache_modifier,
        eviction_policy=eviction_policy,
        volatile=volatile,
    )


def store(ref: Any, idx: Any, val: Any, *, mask: Any = None, eviction_policy: str | None = None) -> None:
    """Stores ``val`` into ``ref[idx]`` where ``mask`` is true.

    Args:
      ref: a Ref (or view); idx: an index (``None`` for the whole Ref).
      val: the value (broadcast to the indexed shape).
      mask: boolean array; masked-off elements are not written.
      eviction_policy: Triton's store hint.
    """
    ref, transforms = _indexer(ref, idx)
    flat, tree = tree_util.tree_flatten(transforms)
    shape = _ref_shape_after(ref, transforms)
    args = [ref, jnp.broadcast_to(jnp.asarray(val, ref.dtype), shape), *flat]
    has_mask = mask is not None
    if has_mask:
        args.append(jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), shape))
    store_p.bind(*args, tree=tree, has_mask=has_mask, eviction_policy=eviction_policy)


def _load_abstract_eval(ref, *args, tree, has_mask, has_other, **_):
    transforms = tree_util.tree_unflatten(tree, args[: tree.num_leaves])
    shape = _ref_shape_after(ref, transforms)
    return jax.core.ShapedArray(shape, ref.dtype), {compat.ReadEffect(0)}


def _store_abstract_eval(ref, val, *args, tree, has_mask, **_):
    return [], {compat.WriteEffect(0)}


load_p.def_effectful_abstract_eval(_load_abstract_eval)
store_p.def_effectful_abstract_eval(_store_abstract_eval)


def _load_discharge(in_avals, out_avals, ref, *args, tree, has_mask, has_other, **_):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    rest = list(args[n:])
    mask = rest.pop(0) if has_mask else None
    other = rest.pop(0) if has_other else None
    x = compat.transform_array(ref, transforms)
    if mask is not None:
        x = jnp.where(mask, x, other if other is not None else jnp.zeros_like(x))
    return (None,) * len(in_avals), x


def _store_discharge(in_avals, out_avals, ref, val, *args, tree, has_mask, **_):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    mask = args[n] if has_mask else None
    if mask is not None:
        old = compat.transform_array(ref, transforms)
        val = jnp.where(mask, val, old)
    new_ref = compat.transform_swap_array(ref, transforms, val)[1]
    return (new_ref,) + (None,) * (len(in_avals) - 1), []


compat.register_discharge_rule(load_p)(_load_discharge)
compat.register_discharge_rule(store_p)(_store_discharge)


# ---------------------------------------------------------------------------
# atomics: old = ref[idx]; ref[idx] = op(old, val); returns old.

atomic_rmw_p = Primitive("plgpu_atomic_rmw")


def _atomic(op: str):
    def fn(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> jax.Array:
        ref_, transforms = _indexer(ref, idx)
        flat, tree = tree_util.tree_flatten(transforms)
        shape = _ref_shape_after(ref_, transforms)
        args = [ref_, jnp.broadcast_to(jnp.asarray(val, ref_.dtype), shape), *flat]
        if mask is not None:
            args.append(jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), shape))
        return atomic_rmw_p.bind(*args, tree=tree, has_mask=mask is not None, op=op)

    fn.__name__ = f"atomic_{op}"
    fn.__doc__ = f"""Atomically applies ``{op}`` of ``val`` to ``ref[idx]`` (where ``mask``).

    Args:
      ref: a Ref; idx: an index (``None`` for the whole Ref); val: the operand.
      mask: optional boolean array; masked-off elements are left alone.
    Returns:
      The values ``ref[idx]`` held before the update.
    """
    return fn


atomic_add = _atomic("add")
atomic_max = _atomic("max")
atomic_min = _atomic("min")


def _atomic_abstract_eval(ref, val, *args, tree, has_mask, op):
    return jax.core.ShapedArray(val.shape, val.dtype), {compat.ReadEffect(0), compat.WriteEffect(0)}


atomic_rmw_p.def_effectful_abstract_eval(_atomic_abstract_eval)


_ATOMIC_FNS = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


def _atomic_discharge(in_avals, out_avals, ref, val, *args, tree, has_mask, op):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    old = compat.transform_array(ref, transforms)
    new = _ATOMIC_FNS[op](old, val)
    if has_mask:
        new = jnp.where(args[n], new, old)
    new_ref = compat.transform_swap_array(ref, transforms, new)[1]
    return (new_ref,) + (None,) * (len(in_avals) - 1), old


compat.register_discharge_rule(atomic_rmw_p)(_atomic_discharge)


# ---------------------------------------------------------------------------
# dot


def dot(
    a: jax.Array,
    b: jax.Array,
    trans_a: bool = False,
    trans_b: bool = False,
    allow_tf32: bool | None = None,
    precision: Any = None,
) -> jax.Array:
    """Matrix product of two 2-d blocks, accumulated in f32 (int32 for ints).

    Args:
      a, b: 2-d arrays (each dim at least 16 on the GPU).
      trans_a, trans_b: use the transpose of ``a``/``b``.
      allow_tf32: ``True`` for TF32 inputs on f32 (fast), ``False`` for IEEE.
      precision: a ``lax.Precision``; overrides ``allow_tf32``.
    Returns:
      ``a @ b`` in the operands' dtype promoted to at least f32 for floats.
    """
    if precision is None and allow_tf32 is not None:
        precision = lax.Precision.DEFAULT if allow_tf32 else lax.Precision.HIGHEST
    lhs_c = 0 if trans_a else 1
    rhs_c = 1 if trans_b else 0
    pref = jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else jnp.int32
    if a.dtype == jnp.float64:
        pref = jnp.float64
    return lax.dot_general(
        a, b, (((lhs_c,), (rhs_c,)), ((), ())), precision=precision, preferred_element_type=pref
    )
