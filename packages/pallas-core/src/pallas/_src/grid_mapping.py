"""Validating a pallas_call's grid, block specs and aliases, and building the
BlockMappings: every error names the kernel, the argument and the user's line."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from pallas._src import compat, primitives
from pallas._src import core as pallas_core
from pallas._src.core import BlockMapping, BlockSpec
from pallas._src.errors import ValueOrTypeError, describe, function_source, python_arity_message

is_spec = lambda x: x is None or x is pallas_core.no_block_spec or isinstance(x, BlockSpec)  # noqa: E731


class Err:
    """Builds messages that name the kernel and the user's line."""

    def __init__(self, name: str, source: str):
        self.name, self.source = name, source

    def __call__(self, cls: type[Exception], what: str, msg: str) -> Exception:
        culprit = f"{what}: " if what else ""
        return cls(f"{describe(self.name, self.source)}: {culprit}{msg}")


def keystr(path) -> str:
    return tree_util.keystr(path) if path else ""


def jax_origin(origin: str) -> str:
    """How JAX's Pallas names an operand in its messages: ``args[0]`` for what
    we call ``in_specs[0]``, ``outputs[0]`` for ``out_specs[0]``."""
    for ours, theirs in (("in_specs", "args"), ("out_specs", "outputs")):
        if origin.startswith(ours):
            return theirs + origin[len(ours) :]
    return origin


def _grid_entries(grid) -> list:
    if grid is None:
        return []
    if isinstance(grid, (int, np.integer, jax.Array, jax.core.Tracer)) and not isinstance(grid, bool):
        return [grid]
    return list(grid) if isinstance(grid, (tuple, list)) else grid


def _grid_size(g, what: str, err: Err):
    """A static int, or the int32 scalar of a dynamic (traced) size."""
    if compat.is_symbolic_dim(g):  # jax.export with symbolic shapes: a size known when the call runs
        g = compat.dimension_as_value(g)
    if isinstance(g, (jax.Array, np.ndarray, jax.core.Tracer)) and not isinstance(g, np.generic):
        if g.size != 1 or not jnp.issubdtype(g.dtype, jnp.integer):
            raise err(
                TypeError,
                what,
                f"a dynamic grid size must be an integer scalar, got {g.dtype}{list(g.shape)}",
            )
        if isinstance(g, jax.core.Tracer):
            return jnp.asarray(g, jnp.int32).reshape(())
        g = int(np.asarray(g).reshape(()))
    if not isinstance(g, (int, np.integer)) or isinstance(g, bool):
        raise err(TypeError, what, f"expected a non-negative int or an integer scalar array, got {g!r}")
    if g < 0:
        raise err(ValueError, what, f"expected a non-negative int, got {g}")
    return int(g)


def normalize_grid(grid, err: Err) -> tuple[tuple, tuple[str | None, ...], list]:
    """(sizes, names, dynamic sizes): a grid axis is a size or a named axis
    ``("i", 4)``; a traced size becomes ``dynamic_grid_dim`` in ``sizes``."""
    entries = _grid_entries(grid)
    if not isinstance(entries, list):
        raise err(TypeError, "grid", f"expected an int or a tuple of ints, got {grid!r}")
    out, names, dynamic = [], [], []
    for i, g in enumerate(entries):
        name = None
        if isinstance(g, (tuple, list)):
            if len(g) != 2 or not isinstance(g[0], str):
                raise err(
                    TypeError, f"grid[{i}]", f"a named grid axis is a pair (name: str, size: int), got {g!r}"
                )
            name, g = g
            if name in names:
                raise err(ValueError, f"grid[{i}]", f"the axis name {name!r} is used twice")
        names.append(name)
        size = _grid_size(g, f"grid[{i}]", err)
        if not isinstance(size, int):
            if name is not None:
                raise err(
                    NotImplementedError, f"grid[{i}]", f"the named grid axis {name!r} needs a static size"
                )
            dynamic.append(size)
            size = pallas_core.dynamic_grid_dim
        out.append(size)
    return tuple(out), tuple(names) if any(n is not None for n in names) else (), dynamic


def _normalize_block_dim(d, what: str, err: Err, array_dim: int):
    if d is None or isinstance(d, pallas_core.Squeezed):
        return pallas_core.squeezed
    if isinstance(d, (pallas_core.Blocked, pallas_core.Element)):
        size = d.block_size
    elif isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        size, d = int(d), pallas_core.Blocked(int(d))
    else:
        raise err(TypeError, what, f"expected an int, None, pl.squeezed, pl.Blocked or pl.Element, got {d!r}")
    if not isinstance(size, (int, np.integer)) or size < 0 or (size == 0 and array_dim != 0):
        raise err(ValueError, what, f"block sizes must be positive ints, got {size!r}")
    if isinstance(d, pallas_core.Element):
        pad = d.padding
        if not isinstance(pad, tuple) or len(pad) != 2 or any(not isinstance(p, int) or p < 0 for p in pad):
            raise err(
                ValueError, what, f"pl.Element padding must be a pair of non-negative ints, got {pad!r}"
            )
    return d


def _index_map_arity_ok(fn: Callable, n: int) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        sig.bind(*range(n))
        return True
    except TypeError:
        return False


def block_mapping(
    spec, aval, origin: str, grid, err: Err, prefetch_avals=(), prefetch_tree=None
) -> BlockMapping:
    """The BlockMapping of the operand ``origin`` (of ``aval``): ``spec``'s
    memory space, block shape and index map checked, the index map traced."""
    shape, dtype = tuple(aval.shape), aval.dtype
    if spec is None or spec is pallas_core.no_block_spec:
        spec = BlockSpec()
    ms = spec.memory_space
    if not pallas_core.is_memory_space(ms):
        raise err(
            TypeError, origin, f"unknown memory_space {ms!r}; expected None, pl.ANY or a backend memory space"
        )
    block_shape, dims = _block_dims(spec.block_shape, shape, dtype, origin, err)
    index_map = _checked_index_map(
        spec.index_map, len(shape), grid, prefetch_avals, prefetch_tree, origin, err
    )
    jaxpr, consts, n_out = _trace_index_map(index_map, grid, prefetch_avals, prefetch_tree, origin, err)
    # The wording after the culprit is JAX's ("Index map function f at x.py:3 for args[0] ...").
    index_map_is = f"Index map function {function_source(index_map)} for {jax_origin(origin)}"
    _check_index_map_outputs(jaxpr, n_out, block_shape, index_map_is, origin, err)
    if pallas_core.is_whole_array_space(ms):
        _check_whole_array_window(dims, jaxpr, shape, dtype, ms, origin, err)
    if consts:
        jaxpr = _close_over(jaxpr, consts, index_map)
        if jaxpr is None:
            raise err(
                ValueError,
                f"{origin}.index_map",
                f"{index_map_is} must not capture constants: "
                f"{', '.join(compat.get_aval(c).str_short() for c in consts)}. An index map computes block "
                "indices from the grid indices (and scalar-prefetch operands: pass a table of indices "
                "with pltpu.PrefetchScalarGridSpec)",
            )
    return BlockMapping(origin, dims, jaxpr, shape, dtype, ms)


def _block_dims(block_shape, shape: tuple, dtype, origin: str, err: Err) -> tuple[tuple | list, tuple]:
    """(the block shape, the array's when None; its dims normalized to
    ``Blocked``/``Element``/``squeezed``), checked against the array."""
    whole = block_shape is None
    if whole:
        block_shape = shape
    if not isinstance(block_shape, (tuple, list)):
        raise err(TypeError, origin, f"block_shape must be a tuple, got {block_shape!r}")
    if len(block_shape) != len(shape):
        raise err(
            ValueError,
            origin,
            f"Block shape for {jax_origin(origin)} (= {tuple(block_shape)}) must have the same number of "
            f"dimensions as the array shape {shape}: block_shape has {len(block_shape)} dims but the "
            f"array {dtype}{list(shape)} has {len(shape)}",
        )
    for i, d in enumerate(block_shape):
        if compat.is_symbolic_dim(d):
            raise _symbolic_block(origin, i, d, shape, dtype, whole, err)
    dims = tuple(
        _normalize_block_dim(d, f"{origin}.block_shape[{i}]", err, n)
        for i, (d, n) in enumerate(zip(block_shape, shape))
    )
    return block_shape, dims


def _symbolic_block(origin: str, i: int, d, shape, dtype, whole: bool, err: Err) -> Exception:
    """A block with a symbolic dimension (``jax.export`` shape polymorphism): blocks
    have static shapes here (JAX's ``pl.lower_as_mlir(dynamic_shapes=True)`` is not supported)."""
    array = f"{dtype}[{', '.join(str(n) for n in shape)}]"
    fix = (
        "give it a pl.BlockSpec with a static block_shape and a grid that follows the array, "
        f"e.g. grid=(pl.cdiv(x.shape[{i}], 8),) with block size 8 along dimension {i}"
    )
    if origin.startswith("constant"):
        msg = (
            f"the kernel closes over an array {array} whose dimension {i} is the symbolic dimension {d} "
            "(jax.export); a captured array becomes a whole-array block, which needs a static shape: "
            f"pass the array to pallas_call as an input instead and {fix}"
        )
    elif whole:
        msg = (
            f"no block_shape was given, so the block is the whole array {array}, whose dimension {i} is "
            f"the symbolic dimension {d} (jax.export); blocks need static shapes: {fix}"
        )
    else:
        return err(
            ValueError,
            f"{origin}.block_shape[{i}]",
            f"the symbolic dimension {d} (jax.export); block sizes must be static ints (blocks of "
            f"symbolic shape, JAX's dynamic_shapes export, are not supported): {fix}",
        )
    return err(ValueError, origin, msg)


def _checked_index_map(index_map, rank: int, grid, prefetch_avals, prefetch_tree, origin: str, err: Err):
    """The index map (all zeros when None), checked to be a callable taking
    one argument per grid axis and scalar-prefetch operand."""
    if index_map is None:
        index_map = lambda *_: (0,) * rank  # noqa: E731
    if not callable(index_map):
        raise err(TypeError, f"{origin}.index_map", f"expected a callable, got {index_map!r}")
    n_prefetch = len(prefetch_avals) if prefetch_tree is None else len(prefetch_tree.children())
    n_args = len(grid) + n_prefetch
    if not _index_map_arity_ok(index_map, n_args):
        extra = f" and {n_prefetch} scalar-prefetch operands" if n_prefetch else ""
        python_says = python_arity_message(index_map, n_args)
        raise err(
            TypeError,
            f"{origin}.index_map",
            f"the grid has {len(grid)} axes, so index_map must take {n_args} arguments "
            f"(one grid index each{extra}); {function_source(index_map)} does not"
            + (f": {python_says}" if python_says else ""),
        )
    return index_map


def _trace_index_map(index_map, grid, prefetch_avals, prefetch_tree, origin: str, err: Err):
    """(closed jaxpr of the index map on int32 grid indices and the
    scalar-prefetch operands, its constants, how many values it returned).
    ``pl.num_programs`` works in the index map, as in the kernel."""
    n_out = []

    def flat_index_map(*idx):
        ctx = primitives.KernelContext(grid, idx[: len(grid)], err.name, index_map_of=origin)
        if prefetch_tree is not None:  # index maps get the scalar-prefetch operands' pytrees back
            idx = (*idx[: len(grid)], *tree_util.tree_unflatten(prefetch_tree, idx[len(grid) :]))
        with primitives.kernel_context(ctx):
            res = index_map(*idx)
        if not isinstance(res, (tuple, list)):
            res = (res,)
        n_out.append(len(res))
        return list(res)

    idx_avals = [compat.shaped_array((), jnp.int32)] * len(grid) + list(prefetch_avals)
    dbg = compat.make_debug_info("pallas_call index_map", index_map, list(range(len(idx_avals))))
    jaxpr, consts = compat.trace_to_closed_jaxpr(flat_index_map, idx_avals, dbg)
    return jaxpr, consts, n_out[0]


def _check_index_map_outputs(
    jaxpr, n_out: int, block_shape, index_map_is: str, origin: str, err: Err
) -> None:
    """One integer scalar per block dimension."""
    if n_out != len(block_shape):
        raise err(
            ValueError,
            f"{origin}.index_map",
            f"{index_map_is} must return {len(block_shape)} values to match block_shape {tuple(block_shape)} "
            f"(one index per block dimension). Currently returning {n_out} values.",
        )
    for i, a in enumerate(jaxpr.out_avals):
        if a.shape != () or not jnp.issubdtype(a.dtype, jnp.integer):
            raise err(
                ValueOrTypeError,
                f"{origin}.index_map",
                f"{index_map_is} must return integer scalars. Output[{i}] has type {a.str_short()}: "
                "return one integer scalar (a block index) per block dimension",
            )


def _check_whole_array_window(dims, jaxpr, shape, dtype, ms, origin: str, err: Err) -> None:
    """In ``pl.ANY`` (and a backend's HBM) the kernel gets the whole array,
    which it reaches by DMAs: a block_shape other than the array's, or an
    index_map not returning zeros, would be ignored, so it is refused (as JAX's
    TPU lowering refuses it)."""
    full = all(getattr(d, "block_size", 1) == n for d, n in zip(dims, shape))  # Squeezed: 1
    zeros = all(hasattr(v, "val") and np.ndim(v.val) == 0 and int(v.val) == 0 for v in jaxpr.jaxpr.outvars)
    if full and zeros:
        return
    name = "pl.ANY" if ms is pallas_core.ANY else repr(ms)  # e.g. HBM (pltpu.HBM)
    raise err(
        ValueError,
        origin,
        f"block_shape {tuple(str(d) for d in dims)} of array {dtype}{list(shape)} in memory space {name}: an "
        "operand in HBM (pl.ANY) is the whole array, which the kernel reaches by DMAs; its BlockSpec takes "
        f"no block_shape other than the array's {shape} and no index_map other than one returning zeros. Use "
        "pl.BlockSpec(memory_space=...) and copy the part you need with a DMA, or a VMEM BlockSpec to get blocks",
    )


def _close_over(jaxpr, consts, index_map):
    """Folds captured scalar constants into a closed jaxpr with no extra inputs;
    None where an array constant stays captured (it cannot become a literal)."""
    fun = compat.jaxpr_as_fun(jaxpr)
    avals = jaxpr.in_avals[len(consts) :]
    dbg = compat.make_debug_info("pallas_call index_map", index_map, avals)
    # A concrete 0-d array (jnp.int32(1)) becomes a numpy scalar, which traces to a literal.
    scalars = [
        np.asarray(c)[()] if np.ndim(c) == 0 and not isinstance(c, jax.core.Tracer) else c for c in consts
    ]
    closed, more = compat.trace_to_closed_jaxpr(lambda *a: fun(*scalars, *a), avals, dbg)
    return None if more else closed


# JAX's words first: a single spec for the inputs is refused (out_specs may be one spec).
IN_SPECS_NOT_A_SEQUENCE = (
    "`in_specs` must be a tuple or a list (one pl.BlockSpec, or pytree of them, per input), "
    "got a single pl.BlockSpec: pass in_specs=[spec]"
)


def flatten_specs(specs, tree_of: tuple, what: str, err: Err) -> list:
    """One spec per leaf of ``tree_of``: the specs' pytree is ``tree_of``'s (as in
    JAX), where a ``None`` may stand for a whole subtree."""
    kind = "inputs" if what == "in_specs" else "outputs"
    if specs is pallas_core.no_block_spec:
        return [None] * len(tree_util.tree_leaves(tree_of))

    def jax_says(specs) -> str:  # JAX's wording, after ours
        specs_tree = tree_util.tree_structure(specs, is_leaf=is_spec)
        return "\n" + compat.pytree_mismatch_message(
            f"`{what}`",
            specs_tree,
            "`inputs`" if what == "in_specs" else "`out_shape`",
            tree_util.tree_structure(tuple(tree_of)),
        )

    if is_spec(specs):
        if what == "in_specs" and specs is not None:
            raise err(ValueError, what, IN_SPECS_NOT_A_SEQUENCE)
        if len(tree_of) != 1:
            raise err(
                ValueError,
                what,
                f"got a single block spec but pallas_call has {len(tree_of)} {kind}; pass a tuple of "
                f"{len(tree_of)}" + jax_says(specs),
            )
        specs = (specs,)
    if not isinstance(specs, (tuple, list)):
        raise err(TypeError, what, f"expected a pl.BlockSpec or a tuple of them, got {specs!r:.80}")
    if len(specs) != len(tree_of):
        raise err(
            ValueError,
            what,
            f"got {len(specs)} block specs but pallas_call has {len(tree_of)} {kind}"
            + jax_says(tuple(specs)),
        )
    flat = []
    for i, (spec, sub) in enumerate(zip(specs, tree_of)):
        # None (the whole array) stands for every leaf below it; a BlockSpec, as in JAX,
        # for one array: the specs' tree must otherwise be the operands' tree.
        spec_tree = tree_util.tree_structure(spec, is_leaf=is_spec)
        try:
            subs = spec_tree.flatten_up_to(sub)  # type: ignore[attr-defined]  # (not in jaxlib's stubs)
        except (ValueError, TypeError):
            subs = None
        leaves = tree_util.tree_leaves(spec, is_leaf=is_spec)
        if subs is not None and all(
            x is None or tree_util.treedef_is_leaf(tree_util.tree_structure(t)) for x, t in zip(leaves, subs)
        ):
            for x, t in zip(leaves, subs):
                if not is_spec(x):
                    raise err(TypeError, f"{what}[{i}]", f"expected a pl.BlockSpec or None, got {x!r:.80}")
                flat += [x] * len(tree_util.tree_leaves(t))
            continue
        raise err(
            ValueError,
            f"{what}[{i}]",
            f"the specs' structure {spec_tree} does not match {kind}[{i}]'s "
            f"{tree_util.tree_structure(sub)}: give one pl.BlockSpec (or None) per array, in the "
            "same structure" + jax_says(tuple(specs)),
        )
    return flat


def check_aliases(aliases, in_avals, out_avals, in_names, out_names, err: Err, n_prefetch: int = 0):
    """(input, output) pairs. As in JAX, input indices count the scalar-prefetch
    operands first; the pairs returned count the other inputs only."""
    if not isinstance(aliases, dict):
        raise err(
            TypeError,
            "input_output_aliases",
            f"expected a dict {{input index: output index}}, got {aliases!r}",
        )
    pairs = []
    for i, o in sorted(aliases.items()):
        if not isinstance(i, int) or not 0 <= i < n_prefetch + len(in_avals):
            raise err(
                ValueError,
                "",
                f"input_output_aliases contains the mapping '{i}:{o}' with input index {i!r} outside "
                f"the range [0, {n_prefetch + len(in_avals)}): there are {n_prefetch + len(in_avals)} inputs",
            )
        if i < n_prefetch:
            raise err(
                ValueError,
                "input_output_aliases",
                f"input {i} is a scalar-prefetch operand, which cannot be aliased to an output",
            )
        if not isinstance(o, int) or not 0 <= o < len(out_avals):
            raise err(
                ValueError,
                "",
                f"input_output_aliases contains the mapping '{i}:{o}' with output index {o!r} outside "
                f"the range [0, {len(out_avals)}): there are {len(out_avals)} outputs",
            )
        a, b = in_avals[i - n_prefetch], out_avals[o]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise err(
                ValueError,
                "",
                f"input_output_aliases contains the mapping '{i}:{o}' referring to input[{i}] with abstract "
                f"value {a.str_short()}, but output[{o}] with a different abstract value {b.str_short()}: "
                f"{in_names[i - n_prefetch]} and {out_names[o]} must have the same shape and dtype",
            )
        pairs.append((i - n_prefetch, o))
    if len({o for _, o in pairs}) != len(pairs):
        raise err(ValueError, "input_output_aliases", "two inputs alias the same output")
    return tuple(pairs)


def const_block_mappings(consts, grid, err, prefetch_avals, prefetch_tree) -> tuple[BlockMapping, ...]:
    return tuple(
        block_mapping(
            BlockSpec(),
            jax.core.ShapedArray(np.shape(c), jnp.result_type(c)),
            f"constant {i} captured by the kernel",
            grid,
            err,
            prefetch_avals,
            prefetch_tree,
        )
        for i, c in enumerate(consts)
    )
