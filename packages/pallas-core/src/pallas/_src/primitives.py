"""Kernel-language primitives shared by every backend."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallas._src import compat, poison
from pallas._src import core as pallas_core
from pallas._src.errors import kernel_error

# ---------------------------------------------------------------------------
# The kernel being traced: grid indices are explicit inputs of the kernel
# jaxpr, so program_id works anywhere in the body (loops, conds, jvp, vmap).


@dataclasses.dataclass
class KernelContext:
    """The kernel, or an operand's index map, being traced: its grid, the grid
    index tracers and its name."""

    grid: tuple[Any, ...]  # ints, or pallas_core.dynamic_grid_dim
    grid_indices: Sequence[Any]  # int32 scalar tracers, one per grid axis
    name: str
    # int32 scalar tracers: the sizes of the grid's dynamic axes, in axis order.
    dynamic_sizes: Sequence[Any] = ()
    # The operand ("in_specs[0]") whose index map is being traced; None in a kernel.
    index_map_of: str | None = None


_ctx = threading.local()


def _kernel_context(what: str) -> KernelContext:
    stack = getattr(_ctx, "stack", None)
    if not stack:
        raise kernel_error(
            RuntimeError,
            f"pl.{what} can only be called inside a kernel traced by pallas_call",
        )
    return stack[-1]


class kernel_context:
    """Context manager that makes ``ctx`` the kernel being traced (``program_id``
    and ``num_programs`` read it)."""

    def __init__(self, ctx: KernelContext):
        self.ctx = ctx

    def __enter__(self):
        if not hasattr(_ctx, "stack"):
            _ctx.stack = []
        _ctx.stack.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc):
        _ctx.stack.pop()


def _check_axis(ctx: KernelContext, axis: int, what: str) -> int:
    if not isinstance(axis, int):
        raise kernel_error(TypeError, f"pl.{what}(axis): axis must be an int, got {axis!r}")
    G = len(ctx.grid)
    if not -G <= axis < G:
        raise kernel_error(
            ValueError,
            f"pl.{what}({axis}): axis out of range for a grid of rank {G} "
            f"(grid={ctx.grid}); valid axes are {-G}..{G - 1}",
        )
    return axis % G


def program_id(axis: int) -> jax.Array:
    """The index of the current program along grid ``axis``.

    Args:
      axis: the grid axis.
    Returns:
      An int32 scalar.
    """
    ctx = _kernel_context("program_id")
    return ctx.grid_indices[_check_axis(ctx, axis, "program_id")]


def num_programs(axis: int) -> int | jax.Array:
    """The size of the grid along ``axis``, in a kernel or in a BlockSpec's index map.

    Args:
      axis: the grid axis.
    Returns:
      A Python int, or an int32 scalar for a dynamic (traced) grid size.
    """
    ctx = _kernel_context("num_programs")
    axis = _check_axis(ctx, axis, "num_programs")
    if ctx.grid[axis] is pallas_core.dynamic_grid_dim:
        if ctx.index_map_of is not None:
            # An index map takes the grid indices (and scalar-prefetch operands) only: the size
            # is a primitive that the engine evaluating the index map answers (eval_index_map).
            return dynamic_grid_size_p.bind(axis=axis)
        dynamic = [a for a, g in enumerate(ctx.grid) if g is pallas_core.dynamic_grid_dim]
        return ctx.dynamic_sizes[dynamic.index(axis)]
    return ctx.grid[axis]


#: ``pl.num_programs(axis)`` of a grid axis of traced size, in an index map.
dynamic_grid_size_p = Primitive("dynamic_grid_size")
dynamic_grid_size_p.def_abstract_eval(lambda *, axis: compat.shaped_array((), jnp.int32))


def eval_index_map(index_map, grid_sizes: Sequence[Any], *args) -> list:
    """``index_map`` (a closed jaxpr) on ``args``, ``pl.num_programs`` of a grid axis of
    traced size (``dynamic_grid_size``) answered from ``grid_sizes``, the grid's sizes
    (ints and int32 scalars)."""
    jaxpr, consts = index_map.jaxpr, index_map.consts
    if not any(e.primitive is dynamic_grid_size_p for e in jaxpr.eqns):
        return compat.jaxpr_as_fun(index_map)(*args)
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, compat.Literal) else env[v]

    for eqn in jaxpr.eqns:
        if eqn.primitive is dynamic_grid_size_p:
            outs = [jnp.asarray(grid_sizes[eqn.params["axis"]], jnp.int32)]
        else:
            outs = eqn.primitive.bind(
                *[read(v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params)
            )
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------
# Named grid axes: lax.axis_index("i") inside a kernel with grid=(("i", n), ...)
# becomes grid_axis_index_p, resolved by the backend from the grid index.

#: ``lax.axis_index`` of a named grid axis inside a kernel.
grid_axis_index_p = Primitive("grid_axis_index")
grid_axis_index_p.def_abstract_eval(lambda *, axis_name: compat.shaped_array((), jnp.int32))


def resolve_grid_axis_names(jaxpr, names):
    """Replaces ``axis_index`` of the grid's axis names by ``grid_axis_index``
    (the grid names are not bound outside the kernel's trace)."""
    names = {n for n in names if n is not None}
    if not names:
        return jaxpr
    axis_index_p = compat.axis_index_primitive()

    def fn(eqn):
        if eqn.primitive is axis_index_p and eqn.params.get("axis_name") in names:
            return eqn.replace(primitive=grid_axis_index_p)
        return eqn

    return compat.map_eqns(jaxpr, fn, compat.named_axis_effects(names))


# ---------------------------------------------------------------------------
# multiple_of: a divisibility hint for the compiler; the identity elsewhere.

#: ``pl.multiple_of``: a hint that a value is a multiple of a constant.
multiple_of_p = Primitive("multiple_of")


def multiple_of(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
    """Tells the compiler that ``x`` is a multiple of ``values``.

    Args:
      x: an integer array (usually a block offset).
      values: the divisor (or one per dimension).
    Returns:
      ``x`` unchanged.
    """
    values = (values,) if isinstance(values, int) else tuple(values)
    if any(not isinstance(v, int) or v <= 0 for v in values):
        raise kernel_error(ValueError, f"pl.multiple_of: values must be positive ints, got {values}")
    return multiple_of_p.bind(x, values=values)


multiple_of_p.def_impl(lambda x, **_: x)
multiple_of_p.def_abstract_eval(lambda aval, **_: aval)
batching.primitive_batchers[multiple_of_p] = lambda args, dims, **p: (
    multiple_of_p.bind(args[0], **p),
    dims[0],
)
ad.deflinear2(multiple_of_p, lambda ct, _, **p: [ct])
mlir.register_lowering(multiple_of_p, lambda ctx, x, **_: [x])


# ---------------------------------------------------------------------------
# debug_print

#: ``pl.debug_print`` inside a kernel.
debug_print_p = Primitive("debug_print")
debug_print_p.multiple_results = True


def debug_print(fmt: str, *args: Any) -> None:
    """Prints ``fmt.format(*args)`` from inside a kernel.

    Args:
      fmt: a format string with ``{}`` placeholders, one per argument.
      *args: scalars or arrays to print.
    """
    if not isinstance(fmt, str):
        raise kernel_error(TypeError, f"pl.debug_print: fmt must be a str, got {type(fmt).__name__}")
    n = fmt.count("{}")
    if n != len(args) and "{" not in fmt.replace("{}", ""):
        raise kernel_error(
            ValueError,
            f"pl.debug_print: format string has {n} placeholders but {len(args)} arguments were given",
        )
    debug_print_p.bind(*map(jnp.asarray, args), fmt=fmt)


def _debug_print_abstract_eval(*avals, fmt):
    from jax._src import debugging

    return [], {debugging.debug_effect}


def _debug_print_lowering(ctx, *args, fmt):
    def f(*a):
        jax.debug.print(fmt, *a)
        return []

    return mlir.lower_fun(f, multiple_results=True)(ctx, *args)


debug_print_p.def_effectful_abstract_eval(_debug_print_abstract_eval)
mlir.register_lowering(debug_print_p, _debug_print_lowering)


def _debug_print_batch(args, dims, *, fmt):
    args = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]
    debug_print_p.bind(*args, fmt=fmt)
    return [], []


batching.primitive_batchers[debug_print_p] = _debug_print_batch


# ---------------------------------------------------------------------------
# run_scoped: scratch Refs that live for the duration of a function.

#: ``pl.run_scoped``: a body run with freshly allocated scratch Refs.
run_scoped_p = Primitive("run_scoped")
run_scoped_p.multiple_results = True


def symbolic_shape_message(shape, what: str) -> str | None:
    """Why a buffer of ``shape`` cannot be allocated when a dimension is symbolic
    (``jax.export`` shape polymorphism), or None."""
    for i, d in enumerate(tuple(shape)):
        if compat.is_symbolic_dim(d):
            return (
                f"{what} of shape ({', '.join(str(n) for n in shape)}): dimension {i} is the symbolic "
                f"dimension {d} (jax.export); a kernel's buffers have static shapes: size it by the "
                "block (a static int), not by the array"
            )
    return None


def scratch_aval(t: Any, where: str):
    symbolic = symbolic_shape_message(getattr(t, "shape", ()), "a scratch buffer")
    if symbolic is not None:
        if where.startswith("scratch_shapes"):
            raise ValueError(f"{where}: {symbolic}")
        raise kernel_error(ValueError, f"{where}: {symbolic}")
    if isinstance(t, pallas_core.MemoryRef):
        return t.get_ref_aval()
    if hasattr(t, "get_ref_aval"):
        return t.get_ref_aval()
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return compat.ref_aval(t.shape, t.dtype)
    msg = f"expected a memory-space shape such as pl.ANY((8, 128), jnp.float32) or a jax.ShapeDtypeStruct, got {t!r}"
    if where.startswith("scratch_shapes"):
        raise TypeError(f"{where}: {msg}")
    raise kernel_error(TypeError, f"{where}: {msg}")


def run_scoped(f: Callable[..., Any], *types: Any, **kw_types: Any) -> Any:
    """Calls ``f`` with freshly allocated (uninitialized) scratch Refs.

    Args:
      f: a function taking one Ref per type.
      *types: the scratch buffers' shapes (``MemoryRef`` such as
        ``pl.ANY((8, 128), jnp.float32)``, a backend memory space's shape, or
        a ``jax.ShapeDtypeStruct``), one positional Ref each.
      **kw_types: likewise, passed to ``f`` by keyword.
    Returns:
      What ``f`` returns (arrays, not Refs).
    """
    flat_types, types_tree = jax.tree.flatten((types, kw_types))
    ref_avals = [scratch_aval(t, "pl.run_scoped") for t in flat_types]
    out_tree_box = []

    def flat_body(*refs):
        args, kwargs = jax.tree.unflatten(types_tree, refs)
        out = f(*args, **kwargs)
        flat_out, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        return flat_out

    dbg = compat.make_debug_info("run_scoped", f, flat_types)
    jaxpr, consts = compat.trace_to_closed_jaxpr(flat_body, ref_avals, dbg)
    outs = run_scoped_p.bind(*consts, jaxpr=jaxpr, num_consts=len(consts))
    return jax.tree.unflatten(out_tree_box[0], outs)


def _run_scoped_abstract_eval(*avals, jaxpr, num_consts):
    effects = set()
    for e in jaxpr.effects:
        if isinstance(e, compat.RefEffect):
            i = compat.effect_input_index(e, jaxpr)
            if i < num_consts:  # effects on scratch refs stay inside
                effects.add(compat.ref_effect_at(e, i))
        else:
            effects.add(e)
    return jaxpr.out_avals, effects


run_scoped_p.def_effectful_abstract_eval(_run_scoped_abstract_eval)


def uninitialized_value(shape, dtype, mode: str = "nan") -> jax.Array:
    """NaN for floats, the smallest value for ints, False for bools: values
    that make reads of never-written memory visible in interpret mode.
    ``mode="zero"`` (an interpreter's ``uninitialized`` option) gives zeros."""
    if mode == "zero":
        return jnp.zeros(shape, dtype)
    if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.full(shape, jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.full(shape, jnp.iinfo(dtype).min, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.full(shape, False, dtype)
    return jnp.zeros(shape, dtype)


def _scoped_fill(shape, dtype) -> jax.Array:
    """A fresh ``pl.run_scoped`` buffer: poison under ``pl.enable_poison_buffers``."""
    if poison.poison_buffers_enabled():
        return jnp.full(shape, poison.poison_value(dtype), dtype)
    return uninitialized_value(shape, dtype)


@compat.register_discharge_rule(run_scoped_p)
def _run_scoped_discharge(ctx, *args, jaxpr, num_consts):
    scratch_avals = jaxpr.in_avals[num_consts:]
    should = [bool(d) and compat.is_ref_aval(a) for d, a in zip(ctx.should_discharge, jaxpr.in_avals)]
    should += [True] * len(scratch_avals)
    pure = compat.discharge(jaxpr, should_discharge=should)
    scratch = [_scoped_fill(a.shape, a.dtype) for a in scratch_avals]
    results = compat.eval_jaxpr(pure.jaxpr, pure.consts, *args, *scratch)
    n_out = len(jaxpr.out_avals)
    outs, ref_finals = results[:n_out], iter(results[n_out:])
    new_invals = [next(ref_finals) if d else None for d in should[:num_consts]]
    return new_invals, outs


# ---------------------------------------------------------------------------
# Python helpers


def when(condition: Any) -> Callable[[Callable[[], None]], None]:
    """Decorator: runs the function only when ``condition`` holds."""

    def decorator(f: Callable[[], None]) -> None:
        if isinstance(condition, bool):
            if condition:
                f()
            return
        lax.cond(condition, f, lambda: None)

    return decorator


def loop(lower: Any, upper: Any, *, init_carry: Any = None, step: Any = 1, unroll: int | bool | None = None):
    """Decorator: ``for i in range(lower, upper, step)`` as a ``fori_loop``.

    The body is ``body(i)``, or ``body(i, carry) -> carry`` when ``init_carry``
    is given; the decorated name is bound to the final carry (or None).
    """
    static = all(isinstance(v, int) for v in (lower, upper, step))
    if static and step == 0:
        raise kernel_error(ValueError, "pl.loop: step must be non-zero")
    if not static:
        dtype = jnp.result_type(lower, upper, step)
        lower, upper, step = (lax.convert_element_type(v, dtype) for v in (lower, upper, step))
    trips = cdiv(upper - lower, step)
    if static:
        trips = max(trips, 0)

    def decorator(body: Callable[..., Any]) -> Any:
        if init_carry is None:
            fn = lambda i, c: (body(lower + i * step), c)[1]  # noqa: E731
        else:
            fn = lambda i, c: body(lower + i * step, c)  # noqa: E731
        kwargs = {} if unroll is None else {"unroll": unroll}
        zero = 0 if static else jnp.zeros((), trips.dtype)
        return lax.fori_loop(zero, trips, fn, init_carry, **kwargs)

    return decorator


def ds(start: Any, size: Any | None = None, stride: int = 1) -> compat.Slice | slice:
    """A slice ``start:start+size*stride:stride`` whose start may be traced.

    Args:
      start: the first index (int or traced int); ``ds(n)`` means ``ds(0, n)``,
        and ``ds(None)`` the whole dimension (``slice(None)``), as in JAX.
      size: the number of elements (a static int).
      stride: the step between elements (a static int >= 0; 0 reads the element at
        ``start`` ``size`` times, a broadcast, as JAX's TPU lowering does).
    """
    if start is None and size is None:
        return slice(None)
    if size is None:
        start, size = 0, start
    if isinstance(size, int) and size < 0:
        raise kernel_error(ValueError, f"pl.ds: size must be non-negative, got {size}")
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 0:
        raise kernel_error(ValueError, f"pl.ds: stride must be an int >= 0, got {stride!r}")
    return compat.Slice(start, size, stride)


dslice = ds


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division; a Python int for int operands, a symbolic dimension for
    symbolic ones (``jax.export`` shapes: usable in ``out_shape`` and grids, as JAX's)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    if all(isinstance(x, int) or compat.is_symbolic_dim(x) for x in (a, b)):
        return (a + b - 1) // b
    return lax.div(a + b - 1, b)


def next_power_of_2(x: int) -> int:
    """The smallest power of two >= ``x`` (for ``x`` >= 0)."""
    if not isinstance(x, int) or x < 0:
        raise ValueError(f"next_power_of_2 expects a non-negative int, got {x!r}")
    return 1 if x == 0 else 1 << (x - 1).bit_length()


def empty(shape, dtype) -> jax.Array:
    """An array of unspecified contents (``jax.lax.empty``)."""
    return lax.empty(shape, dtype)


def empty_like(x: Any) -> Any:
    """``empty`` for every leaf (with ``.shape``/``.dtype``) of a pytree."""
    return jax.tree.map(lambda leaf: lax.empty(leaf.shape, leaf.dtype), x)
