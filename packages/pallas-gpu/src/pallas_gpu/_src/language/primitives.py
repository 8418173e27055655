"""GPU-only kernel primitives: masked ``load``/``store``/``swap``, atomics, ``dot``,
compiler hints (``max_contiguous``, ``debug_barrier``) and inline PTX
(``elementwise_inline_asm``, ``approx_tanh``). Names and signatures follow
the GPU primitives of JAX's (deprecated) Pallas Triton backend.

Each primitive is bound on a Ref plus the flattened NDIndexer transforms
(like JAX's ``get_p``), so the lowering computes the same pointer + mask as
for plain Ref indexing and adds the user's mask on top. In printed jaxprs
they read like JAX's Ref accesses: ``b:f32[8] <- a[:8]`` (load),
``a[:8] <- b`` (store), ``c:f32[8], a[:8] <- a[:8], b`` (swap).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax, tree_util
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from pallas import backend as pallas_backend
from pallas_gpu._src import compat
from pallas_gpu._src.language import printing

# Errors raised while tracing a kernel (kernel_error) name the user's line, not ours.
pallas_backend.register_internal_dir(compat.__file__)


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


def _operand(x: Any, dtype, shape: tuple, what: str, fn: str) -> jax.Array:
    """``x`` as a ``dtype`` array of the indexed ``shape`` (broadcast), or an
    error naming the operand of ``plgpu.<fn>``."""
    x = jnp.asarray(x, dtype)
    try:
        return jnp.broadcast_to(x, shape)
    except ValueError:
        raise pallas_backend.kernel_error(
            ValueError,
            f"plgpu.{fn}: {what} of shape {tuple(x.shape)} does not broadcast to the shape "
            f"{shape} of the indexed Ref; give a {what} of shape {shape} (or one that "
            "broadcasts to it)",
        ) from None


# ---------------------------------------------------------------------------
# load / store

load_p = Primitive("plgpu_load")
store_p = Primitive("plgpu_store")
store_p.multiple_results = True
swap_p = Primitive("plgpu_swap")


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
        args.append(_operand(mask, jnp.bool_, shape, "mask", "load"))
    if has_other:
        args.append(_operand(other, dtype, shape, "other", "load"))
    return load_p.bind(
        *args,
        tree=tree,
        has_mask=has_mask,
        has_other=has_other,
        cache_modifier=cache_modifier,
        eviction_policy=eviction_policy,
        volatile=volatile,
    )


def _value_args(fn: str, ref: Any, args: tuple, mask: Any):
    """(operands ``[Ref, val, *transforms, mask?]``, transforms' tree) of
    ``plgpu.store``/``swap`` called as ``(ref, val)`` or ``(ref, idx, val)``."""
    if len(args) not in (1, 2):
        raise pallas_backend.kernel_error(
            TypeError,
            f"plgpu.{fn} takes (ref, val) or (ref, idx, val) and keyword arguments, got {1 + len(args)} "
            "positional arguments",
        )
    idx, val = (None, args[0]) if len(args) == 1 else args
    ref, transforms = _indexer(ref, idx)
    flat, tree = tree_util.tree_flatten(transforms)
    shape = _ref_shape_after(ref, transforms)
    bound = [ref, _operand(val, ref.dtype, shape, "value", fn), *flat]
    if mask is not None:
        bound.append(_operand(mask, jnp.bool_, shape, "mask", fn))
    return bound, tree


def store(ref: Any, *args: Any, mask: Any = None, eviction_policy: str | None = None) -> None:
    """Stores ``val`` into ``ref`` (or ``ref[idx]``) where ``mask`` is true.

    Called as ``store(ref, val)``, as in JAX's Pallas, or ``store(ref, idx, val)``.

    Args:
      ref: a Ref (or ``ref.at[...]`` view).
      idx: optional index (ints, slices, ``pl.ds``; ``None`` for the whole Ref).
      val: the value (broadcast to the indexed shape).
      mask: boolean array; masked-off elements are not written.
      eviction_policy: Triton's store hint.
    """
    args, tree = _value_args("store", ref, args, mask)
    store_p.bind(*args, tree=tree, has_mask=mask is not None, eviction_policy=eviction_policy)


def swap(ref: Any, *args: Any, mask: Any = None, eviction_policy: str | None = None) -> jax.Array:
    """Stores ``val`` into ``ref[idx]`` where ``mask`` is true and returns the
    values it replaces.

    Called as ``swap(ref, idx, val)``, as in JAX's Pallas, or ``swap(ref, val)``.
    On the GPU this is a (masked) load followed by a (masked) store, not an
    atomic exchange (that is ``plgpu.atomic_xchg``).

    Args:
      ref: a Ref (or ``ref.at[...]`` view).
      idx: optional index (ints, slices, ``pl.ds``; ``None`` for the whole Ref).
      val: the new value (broadcast to the indexed shape).
      mask: boolean array; masked-off elements are neither read nor written.
      eviction_policy: Triton's store hint.
    Returns:
      ``ref[idx]`` as it was before the store where ``mask`` is true, and
      ``val`` where it is false (as in JAX's Pallas).
    """
    args, tree = _value_args("swap", ref, args, mask)
    return swap_p.bind(*args, tree=tree, has_mask=mask is not None, eviction_policy=eviction_policy)


def _load_abstract_eval(ref, *args, tree, has_mask, has_other, **_):
    transforms = tree_util.tree_unflatten(tree, args[: tree.num_leaves])
    shape = _ref_shape_after(ref, transforms)
    return jax.core.ShapedArray(shape, ref.dtype), {compat.ReadEffect(0)}


def _store_abstract_eval(ref, val, *args, tree, has_mask, **_):
    return [], {compat.WriteEffect(0)}


def _swap_abstract_eval(ref, val, *args, tree, has_mask, **_):
    return jax.core.ShapedArray(val.shape, val.dtype), {compat.ReadEffect(0), compat.WriteEffect(0)}


load_p.def_effectful_abstract_eval(_load_abstract_eval)
store_p.def_effectful_abstract_eval(_store_abstract_eval)
swap_p.def_effectful_abstract_eval(_swap_abstract_eval)


def _coords(shape, transforms):
    """Per-dim element coordinates (int arrays of the result's shape) of
    ``ref[transforms]`` for a Ref of ``shape``, unclamped, so that out-of-range
    elements are masked off as on the GPU (``lax.dynamic_slice`` would clamp
    the window); None for integer-array indices."""
    view = [(d, 0, 1, n) for d, n in enumerate(shape)]  # (ref dim, start, stride, size)
    fixed = {}
    for t in transforms:
        if not isinstance(t, compat.NDIndexer):
            return None
        new = []
        for (d, start, stride, _), idx in zip(view, t.indices):
            if isinstance(idx, compat.Slice):
                new.append((d, start + idx.start * stride, stride * idx.stride, idx.size))
            elif jnp.ndim(idx) == 0:
                fixed[d] = start + idx * stride
            else:
                return None
        view = new
    out_shape = tuple(n for *_, n in view)
    axis_of = {v[0]: k for k, v in enumerate(view)}
    coords = []
    for d in range(len(shape)):
        if d in fixed:
            coords.append(jnp.broadcast_to(jnp.asarray(fixed[d], jnp.int32), out_shape))
        else:
            _, start, stride, _ = view[axis_of[d]]
            coords.append(
                jnp.asarray(start, jnp.int32)
                + lax.broadcasted_iota(jnp.int32, out_shape, axis_of[d]) * stride
            )
    return tuple(coords)


def _masked_get(ref, transforms, fill=0):
    coords = _coords(ref.shape, transforms)
    if coords is None:
        return compat.transform_array(ref, transforms)
    return ref.at[coords].get(mode="fill", fill_value=fill, wrap_negative_indices=False)


def _in_range(shape, transforms):
    """Whether each element of ``ref[transforms]`` lies inside a Ref of ``shape``."""
    coords = _coords(shape, transforms)
    if coords is None:  # integer-array indices are clamped, never out of range
        return True
    inside = [(c >= 0) & (c < n) for c, n in zip(coords, shape)]
    return functools.reduce(jnp.logical_and, inside, jnp.bool_(True))


def _masked_set(ref, transforms, val, mask):
    """``ref`` with ``val`` written where ``mask`` (None: everywhere) and in range."""
    coords = _coords(ref.shape, transforms)
    if coords is None:
        if mask is not None:
            val = jnp.where(mask, val, compat.transform_array(ref, transforms))
        return compat.transform_swap_array(ref, transforms, val)[1]
    if mask is not None:  # masked-off elements go out of range, where they are dropped
        coords = tuple(jnp.where(mask, c, -1) for c in coords)
    return ref.at[coords].set(val, mode="drop", wrap_negative_indices=False)


def _load_discharge(in_avals, out_avals, ref, *args, tree, has_mask, has_other, **_):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    rest = list(args[n:])
    mask = rest.pop(0) if has_mask else None
    other = rest.pop(0) if has_other else None
    x = _masked_get(ref, transforms)
    if mask is not None:
        x = jnp.where(mask, x, other if other is not None else jnp.zeros_like(x))
    return (None,) * len(in_avals), x


def _store_discharge(in_avals, out_avals, ref, val, *args, tree, has_mask, **_):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    mask = args[n] if has_mask else None
    return (_masked_set(ref, transforms, val, mask),) + (None,) * (len(in_avals) - 1), []


def _swap_discharge(in_avals, out_avals, ref, val, *args, tree, has_mask, **_):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    mask = args[n] if has_mask else None
    old = _masked_get(ref, transforms)
    if mask is not None:  # as the Triton lowering: elements not read are val
        old = jnp.where(mask & _in_range(ref.shape, transforms), old, val)
    return (_masked_set(ref, transforms, val, mask),) + (None,) * (len(in_avals) - 1), old


compat.register_discharge_rule(load_p)(_load_discharge)
compat.register_discharge_rule(store_p)(_store_discharge)
compat.register_discharge_rule(swap_p)(_swap_discharge)


printing.register(load_p, store_p, swap_p)


# ---------------------------------------------------------------------------
# atomics: old = ref[idx]; ref[idx] = op(old, val); returns old.

atomic_rmw_p = Primitive("plgpu_atomic_rmw")


def _atomic(op: str):
    def fn(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> jax.Array:
        ref_, transforms = _indexer(ref, idx)
        if op in _INT_ONLY and not jnp.issubdtype(ref_.dtype, jnp.integer):
            raise TypeError(
                f"plgpu.atomic_{op} needs a Ref of integers (Triton has no float atomic_{op}), "
                f"got {ref_.dtype}; bitcast the data to an integer dtype"
            )
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


_INT_ONLY = ("and", "or", "xor")
atomic_add = _atomic("add")
atomic_max = _atomic("max")
atomic_min = _atomic("min")
atomic_and = _atomic("and")
atomic_or = _atomic("or")
atomic_xor = _atomic("xor")
atomic_xchg = _atomic("xchg")


def _atomic_abstract_eval(ref, val, *args, tree, has_mask, op):
    return jax.core.ShapedArray(val.shape, val.dtype), {compat.ReadEffect(0), compat.WriteEffect(0)}


atomic_rmw_p.def_effectful_abstract_eval(_atomic_abstract_eval)


_ATOMIC_FNS = {
    "add": jnp.add,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "and": jnp.bitwise_and,
    "or": jnp.bitwise_or,
    "xor": jnp.bitwise_xor,
    "xchg": lambda old, val: val,
}


def _atomic_discharge(in_avals, out_avals, ref, val, *args, tree, has_mask, op):
    n = tree.num_leaves
    transforms = tree_util.tree_unflatten(tree, args[:n])
    old = _masked_get(ref, transforms)
    new_ref = _masked_set(ref, transforms, _ATOMIC_FNS[op](old, val), args[n] if has_mask else None)
    return (new_ref,) + (None,) * (len(in_avals) - 1), old


compat.register_discharge_rule(atomic_rmw_p)(_atomic_discharge)


# atomic_cas: old = ref[...]; ref[...] = val where old == cmp; returns old.

atomic_cas_p = Primitive("plgpu_atomic_cas")


def atomic_cas(ref: Any, cmp: Any, val: Any) -> jax.Array:
    """Atomic compare-and-swap: where ``ref`` holds ``cmp``, writes ``val``.

    Args:
      ref: a Ref or a view (``ref.at[i]``) of 16, 32 or 64-bit elements;
        usually a scalar (a lock or a counter).
      cmp: the expected value (broadcast to the Ref's shape).
      val: the value to swap in (broadcast to the Ref's shape).
    Returns:
      The value the Ref held before the operation.
    """
    ref_, transforms = _indexer(ref, None)
    flat, tree = tree_util.tree_flatten(transforms)
    shape = _ref_shape_after(ref_, transforms)
    if jnp.dtype(ref_.dtype).itemsize not in (2, 4, 8):
        raise TypeError(f"plgpu.atomic_cas needs a Ref of 16, 32 or 64-bit elements, got {ref_.dtype}")
    cmp = jnp.broadcast_to(jnp.asarray(cmp, ref_.dtype), shape)
    val = jnp.broadcast_to(jnp.asarray(val, ref_.dtype), shape)
    return atomic_cas_p.bind(ref_, cmp, val, *flat, tree=tree)


def _atomic_cas_abstract_eval(ref, cmp, val, *args, tree):
    return jax.core.ShapedArray(val.shape, val.dtype), {compat.ReadEffect(0), compat.WriteEffect(0)}


atomic_cas_p.def_effectful_abstract_eval(_atomic_cas_abstract_eval)


def _atomic_cas_discharge(in_avals, out_avals, ref, cmp, val, *args, tree):
    transforms = tree_util.tree_unflatten(tree, args)
    old = compat.transform_array(ref, transforms)
    new_ref = compat.transform_swap_array(ref, transforms, jnp.where(old == cmp, val, old))[1]
    return (new_ref,) + (None,) * (len(in_avals) - 1), old


compat.register_discharge_rule(atomic_cas_p)(_atomic_cas_discharge)


# ---------------------------------------------------------------------------
# Compiler hints

max_contiguous_p = Primitive("plgpu_max_contiguous")


def max_contiguous(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
    """Tells the compiler that the first ``values[d]`` elements of ``x`` along
    each dim ``d`` are contiguous (e.g. offsets from ``iota``), so that loads
    through them vectorize.

    Args:
      x: an integer array (usually offsets).
      values: one int per dim of ``x`` (an int for a 1-d ``x``).
    Returns:
      ``x`` unchanged.
    """
    values = tuple(int(v) for v in (values if isinstance(values, (list, tuple)) else (values,)))
    if len(values) != jnp.ndim(x):
        raise ValueError(
            f"plgpu.max_contiguous: {len(values)} values for an array of rank {jnp.ndim(x)}; "
            "give one value per dimension"
        )
    return max_contiguous_p.bind(x, values=values)


max_contiguous_p.def_abstract_eval(lambda aval, **_: aval)
max_contiguous_p.def_impl(lambda x, **_: x)
mlir.register_lowering(max_contiguous_p, lambda ctx, x, **_: [x])
batching.primitive_batchers[max_contiguous_p] = lambda args, dims, values: (args[0], dims[0])


debug_barrier_p = Primitive("plgpu_debug_barrier")
debug_barrier_p.multiple_results = True


def debug_barrier() -> None:
    """Synchronizes the threads of one program (``tl.debug_barrier``); a no-op
    outside the GPU."""
    debug_barrier_p.bind()


debug_barrier_p.def_effectful_abstract_eval(lambda: ([], {compat.debug_effect}))
debug_barrier_p.def_impl(lambda: [])
mlir.register_lowering(debug_barrier_p, lambda ctx: [])


# ---------------------------------------------------------------------------
# Inline PTX

elementwise_inline_asm_p = Primitive("plgpu_elementwise_inline_asm")
elementwise_inline_asm_p.multiple_results = True


def elementwise_inline_asm(
    asm: str,
    *,
    args: Sequence[jax.Array],
    constraints: str,
    pack: int,
    result_shape_dtypes: Sequence[jax.ShapeDtypeStruct],
) -> Sequence[jax.Array]:
    """Applies inline PTX elementwise (``tl.inline_asm_elementwise``).

    GPU only: neither Triton's CPU interpreter nor Pallas' interpret mode can
    run PTX.

    Args:
      asm: the PTX, with ``$0, $1, ...`` for results then arguments.
      args: arrays of one shape.
      constraints: LLVM inline-asm constraints, e.g. ``"=r,r"``.
      pack: how many elements of each argument one instance of ``asm`` takes.
      result_shape_dtypes: shape (that of ``args``) and dtype of each result.
    Returns:
      The results, one array per entry of ``result_shape_dtypes``.
    """
    args = [jnp.asarray(a) for a in args]
    return elementwise_inline_asm_p.bind(
        *args,
        asm=asm,
        constraints=constraints,
        pack=pack,
        result_shape_dtypes=tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in result_shape_dtypes),
    )


def _inline_asm_abstract_eval(*avals, result_shape_dtypes, **_):
    if any(a.shape != avals[0].shape for a in avals):
        raise ValueError(
            "plgpu.elementwise_inline_asm: all args must have one shape, got "
            f"{[tuple(a.shape) for a in avals]}; broadcast them first"
        )
    return [jax.core.ShapedArray(r.shape, r.dtype) for r in result_shape_dtypes]


def _inline_asm_no_interpret(ctx, *args, **params):
    raise NotImplementedError(
        "plgpu.elementwise_inline_asm runs PTX, which Pallas' interpret mode cannot execute; "
        "run the kernel on the GPU (without interpret=...)"
    )


elementwise_inline_asm_p.def_abstract_eval(_inline_asm_abstract_eval)
mlir.register_lowering(elementwise_inline_asm_p, _inline_asm_no_interpret)


approx_tanh_p = Primitive("plgpu_approx_tanh")


def approx_tanh(x: jax.Array) -> jax.Array:
    """Elementwise approximate tanh: PTX ``tanh.approx.f32`` on the GPU
    (16-bit floats are computed in f32); ``tanh`` under Triton's interpreter
    and in interpret mode.

    Args:
      x: a float16, bfloat16 or float32 array.
    Returns:
      ``tanh(x)`` to about 11 bits of precision on the GPU.
    """
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise TypeError(
            f"plgpu.approx_tanh accepts float16, bfloat16 and float32 arrays, got {x.dtype} "
            "(CUDA has no approximate tanh for other dtypes; use jnp.tanh)"
        )
    return approx_tanh_p.bind(x)


approx_tanh_p.def_abstract_eval(lambda aval: aval)
approx_tanh_p.def_impl(jnp.tanh)
mlir.register_lowering(approx_tanh_p, mlir.lower_fun(jnp.tanh, multiple_results=False))
batching.defvectorized(approx_tanh_p)


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
      a, b: 2-d arrays (any sizes: M and N below 16 are padded by Triton, K below 16 is widened).
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
