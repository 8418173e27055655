"""Kernel jaxpr -> Mosaic: the value model, the rule table and the jaxpr walker.

The kernel becomes one ``func.func`` of a Mosaic module, written with
jaxlib's MLIR Python bindings in the arith, math, vector, memref, scf and tpu
dialects (``lowering_kernel.py`` builds the function, its attributes and the
index-map functions). Conventions:

* A jaxpr value of shape ``()`` is an MLIR scalar (``i32``, ``f32``, ``i1``
  for bool); any other shape is a ``vector<...>`` of that shape. Unsigned
  integers are signless MLIR integers: rules read signedness from the avals.
* A Ref is a ``memref`` in its memory space (``#tpu.memory_space<vmem>``,
  ``smem``, ``hbm``, ``any``, ``semaphore_mem``); a semaphore Ref is a memref of
  ``!tpu.semaphore`` or ``!tpu.dma_semaphore``; a bool Ref is a memref of i32
  (0/1), converted at loads and stores and at the custom call. ``ref.at[...]`` views become
  ``tpu.memref_slice`` (+ ``tpu.memref_squeeze``) where an op needs a memref.
* A PRNG key array (``jax.random.key``) is its key data: ``key<fry>[n]`` is
  the value of a ``uint32[n, 2]`` (``physical``). Rules see physical avals,
  except the rules of PRNG primitives (``key_rules``); a structural primitive
  on keys lowers only where ``key_params`` says how (``lowering_random.py``).
* A rule is ``rule(ctx, *args, **params) -> value or list of values``; ``ctx``
  holds the equation, its avals and the kernel (``RuleContext``). Rules are
  registered with ``register_lowering(*prims)`` and live by theme:
  ``lowering_math.py`` (elementwise, casts, bitcasts, special functions),
  ``lowering_shapes.py`` (iota, broadcasts, reshapes, slices, pad, hints),
  ``lowering_reductions.py`` (reductions, scans, top_k, dot),
  ``lowering_memory.py`` (Ref reads/writes, gathers, dynamic slices, scratch;
  on ``lowering_views.py``, Ref views, and ``lowering_windows.py``, the
  forms of the accesses), ``lowering_dma.py`` (DMAs, semaphores, device ids,
  delay, the core's PRNG, debug_print), ``lowering_control.py`` (cond, loops,
  inlined calls), ``lowering_random.py`` and ``lowering_sort.py``. Imports
  run one way: those modules import this one (and helpers of each other,
  without a circle), ``lowering_kernel.py`` imports them all.
* A primitive without a rule, and any error raised inside a rule, is a
  ``LoweringException`` naming the primitive, the kernel and the user's line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector

from pallas import backend as plb
from pallas_tpu._src import compat

BACKEND = "pallas_tpu (Mosaic)"
# Bools live in memory as int32 0/1 (Refs, kernel operands and outputs), as in JAX.
BOOL_MEMORY_DTYPE = np.dtype(np.int32)


class LoweringException(NotImplementedError):
    """A kernel that cannot be lowered to Mosaic (JAX's ``pltpu.LoweringException``;
    a ``NotImplementedError``, as a missing rule is)."""


Rule = Callable[..., Any]
lowering_rules = plb.RuleTable(BACKEND)
register_lowering = lowering_rules.register
# Primitives whose rules take PRNG key avals as they are (random_seed, ...).
key_rules: set[Any] = set()
# How a primitive's params change when its key operands are key data:
# ``key_params[p](params, avals_in, avals_out) -> params`` (raises where it cannot).
key_params: dict[Any, Callable[..., dict]] = {}


# ---------------------------------------------------------------------------
# Types


# The dtype predicates are asked for every equation's avals: cached per dtype (jnp.issubdtype
# is slow beside a dict lookup).
@functools.cache
def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@functools.cache
def is_bool(dtype) -> bool:
    return np.dtype(dtype) == np.bool_


@functools.cache
def is_unsigned(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.unsignedinteger) or is_bool(dtype)


@functools.cache
def _integer_bits(dtype) -> int | None:
    """The width of an integer ``dtype`` (int4 is 4 bits); None for any other dtype."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.dtypes.itemsize_bits(dtype)
    return None


_FLOAT_TYPES = {
    "float32": ir.F32Type.get,
    "bfloat16": ir.BF16Type.get,
    "float16": ir.F16Type.get,
    "float64": ir.F64Type.get,
    "float8_e4m3fn": ir.Float8E4M3FNType.get,
    "float8_e5m2": ir.Float8E5M2Type.get,
}


def element_type(dtype) -> ir.Type:
    """The MLIR element type of ``dtype`` (integers are signless; bool is i1)."""
    dtype = np.dtype(dtype)
    if is_bool(dtype):
        return ir.IntegerType.get_signless(1)
    bits = _integer_bits(dtype)
    if bits is not None:  # int4 is i4, int2 is i2 (as JAX lowers them)
        return ir.IntegerType.get_signless(bits)
    if dtype.name in _FLOAT_TYPES:
        return _FLOAT_TYPES[dtype.name]()
    raise NotImplementedError(f"{BACKEND}: dtype {dtype.name} has no Mosaic type")


def value_type(shape: Sequence[int], dtype) -> ir.Type:
    """A scalar type for shape ``()``, else a vector type."""
    el = element_type(dtype)
    return ir.VectorType.get(list(shape), el) if len(shape) else el


@dataclasses.dataclass(frozen=True)
class Aval:
    """A shape and dtype (what rules need of an abstract value)."""

    shape: tuple
    dtype: Any

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


@functools.cache
def is_key(dtype) -> bool:
    """Whether ``dtype`` is a PRNG key dtype (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def physical(aval):
    """The aval of a value's data: a key array's key data, else ``aval``."""
    return compat.physical_aval(aval) if is_key(aval.dtype) else aval


def aval_type(aval) -> ir.Type:
    aval = physical(aval)
    return value_type(aval.shape, aval.dtype)


def memory_space_attr(ms) -> ir.Attribute:
    """``#tpu.memory_space<...>`` of a Ref's memory space (None is VMEM)."""
    if isinstance(ms, plb.SemaphoreSpace):
        name = "semaphore_mem"
    elif ms is None:
        name = "vmem"
    else:
        name = str(ms)
        if name not in ("vmem", "smem", "hbm", "any", "semaphore_mem", "vmem_shared", "cmem"):
            raise NotImplementedError(f"{BACKEND}: memory space {ms!r} has no Mosaic equivalent")
    return ir.Attribute.parse(f"#tpu.memory_space<{name}>")


def semaphore_type(kind) -> ir.Type:
    dma = kind is plb.SemaphoreKind.DMA
    return ir.Type.parse("!tpu.dma_semaphore" if dma else "!tpu.semaphore")


def memref_type(shape: Sequence[int], dtype, memory_space) -> ir.MemRefType:
    """The memref of a Ref of ``shape``/``dtype`` in ``memory_space``."""
    if isinstance(memory_space, plb.SemaphoreSpace):
        el = semaphore_type(memory_space.kind)
    elif is_bool(dtype):
        el = element_type(BOOL_MEMORY_DTYPE)
    else:
        el = element_type(dtype)
    return ir.MemRefType.get(list(shape), el, memory_space=memory_space_attr(memory_space))


def ref_type(aval) -> ir.MemRefType:
    return memref_type(aval.shape, aval.dtype, aval.memory_space)


def is_smem(aval) -> bool:
    return str(getattr(aval, "memory_space", None)) == "smem"


# ---------------------------------------------------------------------------
# Values

# arith.constant(result type, value attribute): jaxlib's arith.py redefines the generated
# constant(value) of its star import, and mypy keeps the generated one's signature.
_arith_constant = cast(Callable[[ir.Type, Any], ir.Value], arith.constant)


def i32(v: int) -> ir.Value:
    t = ir.IntegerType.get_signless(32)
    return _arith_constant(t, ir.IntegerAttr.get(t, int(v)))


def index(v: int | ir.Value) -> ir.Value:
    """``v`` (a Python int or an integer scalar) as an MLIR ``index``."""
    if isinstance(v, ir.Value):
        if isinstance(v.type, ir.IndexType):
            return v
        return arith.index_cast(ir.IndexType.get(), v)
    return _arith_constant(ir.IndexType.get(), int(v))


def as_i32(v: int | ir.Value) -> ir.Value:
    if isinstance(v, ir.Value):
        if isinstance(v.type, ir.IndexType):
            return arith.index_cast(ir.IntegerType.get_signless(32), v)
        return v
    return i32(v)


def constant(value, shape: Sequence[int], dtype) -> ir.Value:
    """A constant scalar (``shape == ()``) or splat vector."""
    el = element_type(dtype)
    attr: ir.Attribute
    if is_float(dtype):
        attr = ir.FloatAttr.get(el, float(value))
    else:
        v = int(value)
        width = ir.IntegerType(el).width
        if width > 1 and v >= 2 ** (width - 1):  # unsigned values in a signless type
            v -= 2**width
        if width == 1:
            v = -1 if v else 0
        attr = ir.IntegerAttr.get(el, v)
    if not len(shape):
        return _arith_constant(el, attr)
    t = ir.VectorType.get(list(shape), el)
    return _arith_constant(t, ir.DenseElementsAttr.get_splat(t, attr))


def broadcast_to(x: ir.Value, shape: Sequence[int]) -> ir.Value:
    """A scalar or vector broadcast to ``shape`` (numpy rules)."""
    if not len(shape):
        return x
    t = x.type
    el = ir.VectorType(t).element_type if isinstance(t, ir.VectorType) else t
    if isinstance(t, ir.VectorType) and list(ir.VectorType(t).shape) == list(shape):
        return x
    return vector.broadcast(ir.VectorType.get(list(shape), el), x)


def shape_cast(x: ir.Value, shape: Sequence[int], dtype) -> ir.Value:
    """``x`` with the same elements in ``shape`` (scalars <-> 1-element vectors)."""
    is_vec = isinstance(x.type, ir.VectorType)
    if not len(shape):
        if not is_vec:
            return x
        return vector.extract(x, [], [0] * len(ir.VectorType(x.type).shape))
    if not is_vec:
        return vector.broadcast(value_type(shape, dtype), x)
    if list(ir.VectorType(x.type).shape) == list(shape):
        return x
    return vector.shape_cast(value_type(shape, dtype), x)


@dataclasses.dataclass(frozen=True)
class BlockRef:
    """A kernel operand whose block has squeezed dims (``None`` in its block
    shape): the memref keeps them with size 1, as Mosaic's window does; the
    kernel's Ref does not (accesses index them with 0)."""

    memref: ir.Value
    squeezed: tuple[bool, ...]


# ---------------------------------------------------------------------------
# The kernel being lowered and the walker


@dataclasses.dataclass
class KernelContext:
    """What rules need of the kernel: its name, the grid and the device mesh."""

    kernel_name: str
    source: str
    grid: tuple[int, ...]
    grid_names: tuple[str | None, ...]
    grid_indices: list[ir.Value]
    # ((name, size), ...) of the device mesh the kernel runs in (jax.shard_map).
    mesh_axes: tuple[tuple[str, int], ...] = ()
    # MXU -> its first accumulator entry not held by an open pl.run_scoped (lowering_mxu.py).
    acc_offsets: dict[int, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return plb.describe(self.kernel_name, self.source)


@dataclasses.dataclass
class RuleContext:
    """One equation being lowered."""

    kernel: KernelContext
    eqn: Any
    avals_in: list[Any]
    avals_out: list[Any]

    def lower_jaxpr(self, jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[ir.Value]:
        """Lowers a sub-jaxpr (a branch, a loop body) at the current insertion point."""
        return lower_jaxpr(self.kernel, jaxpr, [*consts, *args])


def _where(eqn) -> str:
    line = compat.eqn_user_source(eqn)
    return f" at {line}" if line else ""


def lower_jaxpr(
    kernel: KernelContext, jaxpr, args: Sequence[Any], own_locations: bool = True
) -> list[ir.Value]:
    """Emits ``jaxpr`` (invars bound to ``args``) at the current insertion
    point; returns the values of its outvars. Each op carries the location of
    its equation, or with ``own_locations=False`` the current one (a composite
    op's ``jnp`` definition, traced inside our rule, speaks for the user's equation)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if jaxpr.constvars:
        raise LoweringException(
            f"{kernel.describe()}: the kernel closes over array constants, which Mosaic cannot take; "
            "pass them as inputs"
        )

    def literal(v):
        return constant(v.val, (), v.aval.dtype) if not np.shape(v.val) else _literal_array(v)

    def lower_eqn(eqn, read):
        rule = lowering_rules.get(eqn.primitive)
        if rule is None:
            raise LoweringException(
                f"{kernel.describe()}: primitive '{eqn.primitive.name}'{_where(eqn)} has no "
                f"Mosaic lowering in {BACKEND}; run the kernel with interpret=pltpu.InterpretParams() "
                "or rewrite it with supported operations"
            )
        avals_in, avals_out = [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]
        params = eqn.params
        if eqn.primitive not in key_rules and any(is_key(a.dtype) for a in avals_in + avals_out):
            params = _key_data_params(kernel, eqn, avals_in, avals_out)
            avals_in, avals_out = list(map(physical, avals_in)), list(map(physical, avals_out))
        ctx = RuleContext(kernel, eqn, avals_in, avals_out)
        try:
            with compat.eqn_location(eqn) if own_locations else contextlib.nullcontext():
                return rule(ctx, *map(read, eqn.invars), **params)
        except LoweringException:
            raise
        except Exception as e:
            raise LoweringException(
                f"{kernel.describe()}: lowering '{eqn.primitive.name}'{_where(eqn)} to Mosaic failed: {e}"
            ) from e

    return plb.walk_jaxpr(jaxpr, args, literal=literal, lower_eqn=lower_eqn)


def _key_data_params(kernel, eqn, avals_in, avals_out) -> dict:
    """The params of ``eqn`` (which has PRNG key operands or results) for its
    rule on key data, or a ``LoweringException`` naming it."""
    translate = key_params.get(eqn.primitive)
    try:
        if translate is None:
            raise NotImplementedError("it has no rule for key data")
        return translate(dict(eqn.params), avals_in, avals_out)
    except NotImplementedError as e:
        raise LoweringException(
            f"{kernel.describe()}: primitive '{eqn.primitive.name}'{_where(eqn)} on PRNG key arrays has "
            f"no Mosaic lowering in {BACKEND} ({e}); apply it to the key data "
            "(jax.random.key_data / wrap_key_data) or to the random values instead"
        ) from e


def lower_fun(
    fn: Callable[..., Any],
    ctx: RuleContext,
    *args,
    multiple_results: bool = False,
    avals_in: Sequence[Any] | None = None,
    **params,
):
    """Lowers a composite op through its ``jnp`` definition ``fn(*args, **params)``
    (traced on ``avals_in``, by default the equation's input avals) and the existing rules."""
    jaxpr = plb.trace_composite(fn, avals_in or ctx.avals_in, ctx.eqn.primitive.name, **params)
    outs = lower_jaxpr(ctx.kernel, jaxpr, args, own_locations=False)
    return outs if multiple_results else outs[0]


def _literal_array(lit) -> ir.Value:
    val = np.asarray(lit.val)
    if not np.all(val == val.flat[0]):
        raise NotImplementedError("only splat array literals are supported")
    return constant(val.flat[0], val.shape, val.dtype)
