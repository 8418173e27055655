"""Kernel jaxpr + grid mapping -> the source of one ``@triton.jit`` kernel.

We emit Triton *Python source*, not IR through private builders: the source
survives Triton releases, is readable (``debug=True`` prints it), and the same
text runs on the CPU under Triton's interpreter.

Conventions of the generated code:

* Every jaxpr value is a Python variable holding a Triton tensor (0-d values
  are Triton scalars). Triton tensor dims must be powers of two, so a value of
  logical shape ``(5, 12)`` is held padded to ``(8, 16)``; the padding holds
  garbage, and rules whose result depends on it (reductions, dots, scans,
  reversals) first replace it with a neutral value.
* A block Ref is a base pointer plus per-array-dimension element starts
  computed from the index maps at the top of the kernel. Loads and stores build
  ``pointer + offsets`` and a mask that keeps every access inside the array.
* Scratch Refs (``scratch_shapes``, ``pl.run_scoped``) live in registers as a
  reassigned variable.

This file holds the emitter, memory ops, control flow and the kernel frame;
``lowering_math.py`` holds elementwise math, shapes, reductions and dots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import tree_util

from pallas import backend as pallas_backend
from pallas_gpu._src import compat
from pallas_gpu._src import primitives as gpu_primitives

BACKEND = "pallas_gpu (Triton)"
# Triton's launch-grid limits per axis.
MAX_GRID_X = 2**31 - 1


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pad_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(next_pow2(d) for d in shape)


# numpy dtype -> (triton.language name, signature name of a pointer to it).
_DTYPES = {
    "float16": ("tl.float16", "fp16"),
    "bfloat16": ("tl.bfloat16", "bf16"),
    "float32": ("tl.float32", "fp32"),
    "float64": ("tl.float64", "fp64"),
    "int8": ("tl.int8", "i8"),
    "int16": ("tl.int16", "i16"),
    "int32": ("tl.int32", "i32"),
    "int64": ("tl.int64", "i64"),
    "uint8": ("tl.uint8", "u8"),
    "uint16": ("tl.uint16", "u16"),
    "uint32": ("tl.uint32", "u32"),
    "uint64": ("tl.uint64", "u64"),
    "bool": ("tl.int1", "i8"),  # bool buffers are stored as bytes
    "float8_e4m3fn": ("tl.float8e4nv", "fp8e4nv"),
    "float8_e5m2": ("tl.float8e5", "fp8e5"),
}


def tl_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise NotImplementedError(f"{BACKEND}: dtype {name} is not supported by Triton")
    return _DTYPES[name][0]


def pointer_signature(dtype: Any) -> str:
    return "*" + _DTYPES[np.dtype(dtype).name][1]


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_bool(dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def is_signed_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.signedinteger)


def is_unsigned_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.unsignedinteger)


# ---------------------------------------------------------------------------
# Values


@dataclasses.dataclass
class Val:
    """A jaxpr value in the generated code: a Python expression (a variable
    name or a literal) of logical ``shape`` held padded to ``pad_shape``."""

    expr: str
    shape: tuple[int, ...]
    dtype: np.dtype
    static: Any = None  # the Python value when known at trace time

    @property
    def padded(self) -> tuple[int, ...]:
        return pad_shape(self.shape)

    @property
    def is_padded(self) -> bool:
        return self.padded != tuple(self.shape)


@dataclasses.dataclass
class BlockRef:
    """A block of an array in global memory (an input/output Ref).

    ``starts[d]`` is the element offset of the block along array dim ``d``
    (an expression); ``in_bounds[d]`` says that the whole block is statically
    known to lie inside the array along ``d``.
    """

    ptr: str
    array_shape: tuple[int, ...]
    dtype: np.dtype
    starts: list[str]
    kernel_dims: list[int]  # array dims the kernel sees (squeezed ones removed)
    block_shape: tuple[int, ...]  # kernel block shape
    in_bounds: list[bool]
    nonnegative: list[bool]


@dataclasses.dataclass
class ScratchRef:
    """A Ref held in registers: ``var`` is reassigned by stores."""

    var: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass
class DimView:
    """One kernel-block dim after ``ref.at[...]``/indexing: a scalar index
    (``size is None``) or a strided slice."""

    start: str | int
    size: int | None
    stride: int = 1


class LoweringError(NotImplementedError):
    pass


# ---------------------------------------------------------------------------
# The emitter


class Emitter:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 1
        self.counter = 0
        self.helpers: dict[str, str] = {}

    def fresh(self, hint: str = "v") -> str:
        self.counter += 1
        return f"{hint}{self.counter}"

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def assign(self, expr: str, shape, dtype, hint: str = "v") -> Val:
        name = self.fresh(hint)
        self.emit(f"{name} = {expr}")
        return Val(name, tuple(shape), np.dtype(dtype))

    def helper(self, name: str, source: str) -> str:
        """Adds a module-level ``@triton.jit`` helper (combine fns) once."""
        self.helpers.setdefault(name, source)
        return name

    class _Block:
        def __init__(self, em: Emitter, header: str | None):
            self.em, self.header = em, header

        def __enter__(self):
            if self.header is not None:
                self.em.emit(self.header)
                self.em.depth += 1
            n = len(self.em.lines)
            self._start = n
            return self

        def __exit__(self, *exc):
            if len(self.em.lines) == self._start:
                self.em.emit("pass")
            if self.header is not None:
                self.em.depth -= 1

    def block(self, header: str) -> Emitter._Block:
        return Emitter._Block(self, header)


# ---------------------------------------------------------------------------
# Rules


@dataclasses.dataclass
class RuleContext:
    em: Emitter
    eqn: Any
    avals_in: Sequence[Any]
    avals_out: Sequence[Any]
    lowering: KernelLowering

    def out(self, expr: str, i: int = 0, hint: str = "v") -> Val:
        """Assigns ``expr`` to a fresh variable shaped like output ``i``."""
        a = self.avals_out[i]
        return self.em.assign(expr, a.shape, a.dtype, hint)

    def error(self, msg: str) -> LoweringError:
        return LoweringError(
            f"{BACKEND}: in kernel '{self.lowering.name}' at {self.lowering.source_line(self.eqn)}: "
            f"primitive '{self.eqn.primitive.name}': {msg}"
        )


Rule = Callable[..., Any]
lowering_rules: dict[Any, Rule] = {}


def register_lowering(*prims):
    def deco(fn: Rule) -> Rule:
        for p in prims:
            lowering_rules[p] = fn
        return fn

    return deco


# ---------------------------------------------------------------------------
# Constants, casts and padding helpers used by rules


def const(em: Emitter, value: Any, dtype, shape=()) -> Val:
    """A tensor constant of exactly ``dtype`` (Python literals would be
    constexprs with Triton's own promotion rules)."""
    dtype = np.dtype(dtype)
    if is_bool(dtype):
        lit = "1" if bool(value) else "0"
    elif is_float(dtype):
        v = float(value)
        lit = (
            "float('nan')"
            if math.isnan(v)
            else ("float('inf')" if v == math.inf else ("float('-inf')" if v == -math.inf else repr(v)))
        )
    else:
        lit = str(int(value))
    shp = list(pad_shape(shape))
    if dtype.name == "bfloat16":  # Triton's interpreter has no bf16 constants
        expr = f"tl.full({shp}, {lit}, tl.float32).to(tl.bfloat16)"
    else:
        expr = f"tl.full({shp}, {lit}, {tl_dtype(dtype)})"
    v = em.assign(expr, shape, dtype, "c")
    if shape == ():
        v.static = value
    return v


def cast(em: Emitter, x: Val, dtype) -> Val:
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if is_bool(dtype):
        zero = const(em, 0, x.dtype)
        return em.assign(f"{x.expr} != {zero.expr}", x.shape, dtype)
    return em.assign(f"{x.expr}.to({tl_dtype(dtype)})", x.shape, dtype)


def expand_to_axis(vec: str, axis: int, rank: int) -> str:
    """Places a 1-d expression on ``axis`` of a rank-``rank`` tensor."""
    if rank == 1:
        return vec
    idx = ", ".join(":" if i == axis else "None" for i in range(rank))
    return f"{vec}[{idx}]"


def valid_mask(shape: Sequence[int], axes: Sequence[int] | None = None) -> str | None:
    """A boolean expression, broadcastable to the padded shape, true on the
    logical elements along ``axes`` (default all); None if none are padded."""
    rank = len(shape)
    terms = []
    for ax in range(rank) if axes is None else axes:
        n = shape[ax]
        if next_pow2(n) != n:
            terms.append(f"({expand_to_axis(f'tl.arange(0, {next_pow2(n)})', ax, rank)} < {n})")
    return " & ".join(terms) if terms else None


def fill_padding(em: Emitter, x: Val, value: Any, axes: Sequence[int] | None = None) -> Val:
    """``x`` with its padding along ``axes`` replaced by ``value``."""
    m = valid_mask(x.shape, axes)
    if m is None:
        return x
    c = const(em, value, x.dtype)
    return em.assign(f"tl.where({m}, {x.expr}, {c.expr})", x.shape, x.dtype)


# ---------------------------------------------------------------------------
# Memory: get / swap / addupdate on block and scratch Refs


def _apply_indexers(ref, transforms, rule_ctx: RuleContext) -> list[DimView]:
    shape = ref.block_shape if isinstance(ref, BlockRef) else ref.shape
    view = [DimView(0, n) for n in shape]
    for t in transforms:
        if not isinstance(t, compat.NDIndexer):
            raise rule_ctx.error(f"Ref transform {type(t).__name__} is not supported")
        live = [i for i, v in enumerate(view) if v.size is not None]
        if len(t.indices) != len(live):
            raise rule_ctx.error(f"indexer {t} does not match the Ref's {len(live)} dims")
        for i, idx in zip(live, t.indices):
            v = view[i]
            if isinstance(idx, compat.Slice):
                start = _scalar_expr(idx.start, rule_ctx)
                view[i] = DimView(_add(v.start, _mul(start, v.stride)), idx.size, v.stride * idx.stride)
            elif isinstance(idx, Val):
                if idx.shape != ():
                    raise rule_ctx.error(
                        "indexing a Ref with an array (gather/scatter) is not supported by the "
                        "Triton backend; use pl.ds slices, or plgpu.load with computed pointers"
                    )
                view[i] = DimView(_add(v.start, _mul(_scalar_expr(idx, rule_ctx), v.stride)), None)
            elif isinstance(idx, (int, np.integer)):
                view[i] = DimView(_add(v.start, int(idx) * v.stride), None)
            else:
                raise rule_ctx.error(f"unsupported index {idx!r}")
    return view


def _scalar_expr(x, rule_ctx) -> str | int:
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, Val):
        if x.static is not None and not isinstance(x.static, bool):
            return int(x.static)
        return x.expr
    raise rule_ctx.error(f"unsupported index {x!r}")


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0:
        return b
    if b == 0:
        return a
    return f"({a} + {b})"


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 1:
        return b
    if b == 1:
        return a
    if a == 0 or b == 0:
        return 0
    return f"({a} * {b})"


def block_address(em: Emitter, ref: BlockRef, view: list[DimView]) -> tuple[str, str | None, tuple[int, ...]]:
    """(pointer expression, mask expression or None, logical result shape)."""
    out_shape = tuple(v.size for v in view if v.size is not None)
    rank = len(out_shape)
    kdim = {d: k for k, d in enumerate(ref.kernel_dims)}
    wide = math.prod(ref.array_shape) >= 2**31
    offsets, masks = [], []
    axis = 0
    for d, n in enumerate(ref.array_shape):
        stride = math.prod(ref.array_shape[d + 1 :])
        base = ref.starts[d]
        if wide and base != 0:
            base = f"{base}.to(tl.int64)"
        v = view[kdim[d]] if d in kdim else DimView(0, None)
        block = ref.block_shape[kdim[d]] if d in kdim else 1
        static_start = isinstance(v.start, int)
        if v.size is None:
            off = _add(base, v.start)
            safe = ref.in_bounds[d] and static_start and 0 <= v.start < block
            if not safe:
                name = em.fresh("i")
                em.emit(f"{name} = {off}")
                off = name
                masks.append(f"({off} < {n})")
                if not (ref.nonnegative[d] and static_start and v.start >= 0):
                    masks.append(f"({off} >= 0)")
        else:
            p = next_pow2(v.size)
            ar = f"tl.arange(0, {p})"
            lin = _add(_add(base, v.start), _mul(ar, v.stride) if v.stride != 1 else ar)
            name = em.fresh("offs")
            em.emit(f"{name} = {expand_to_axis(lin if isinstance(lin, str) else str(lin), axis, rank)}")
            off = name
            last = v.start + (v.size - 1) * v.stride if static_start else None
            safe = ref.in_bounds[d] and static_start and 0 <= v.start and last < block and v.stride > 0
            if p != v.size:
                masks.append(f"({expand_to_axis(ar, axis, rank)} < {v.size})")
            if not safe:
                masks.append(f"({off} < {n})")
                if not (ref.nonnegative[d] and static_start and v.start >= 0 and v.stride > 0):
                    masks.append(f"({off} >= 0)")
            axis += 1
        if n > 1:
            offsets.append(_mul(off, stride))
    ptr = ref.ptr
    for o in offsets:
        if o != 0:
            ptr = f"{ptr} + {o}"
    return ptr, (" & ".join(masks) if masks else None), out_shape


def _load_ref(rc: RuleContext, ref, view, out_dtype) -> Val:
    em = rc.em
    if isinstance(ref, ScratchRef):
        _check_whole(rc, ref, view)
        return em.assign(ref.var, ref.shape, ref.dtype)
    ptr, mask, shape = block_address(em, ref, view)
    if mask is None:
        expr = f"tl.load({ptr})"
    else:
        m = em.fresh("mask")
        em.emit(f"{m} = {mask}")
        expr = f"tl.load({ptr}, mask={m}, other=0)"
    if is_bool(ref.dtype):
        expr = f"{expr} != 0"
    return em.assign(expr, shape, out_dtype)


def _store_ref(rc: RuleContext, ref, view, val: Val) -> None:
    em = rc.em
    if isinstance(ref, ScratchRef):
        _check_whole(rc, ref, view)
        em.emit(f"{ref.var} = {val.expr}")
        return
    ptr, mask, shape = block_address(em, ref, view)
    x = val.expr
    if shape != val.shape:
        raise rc.error(f"storing a {val.shape} value into a {shape} slice of a Ref")
    if is_bool(ref.dtype):
        x = f"{x}.to(tl.int8)"
    if shape == () and val.shape == ():
        pass
    if mask is None:
        em.emit(f"tl.store({ptr}, {x})")
    else:
        em.emit(f"tl.store({ptr}, {x}, mask={mask})")


def _check_whole(rc: RuleContext, ref: ScratchRef, view: list[DimView]) -> None:
    if any(v.size is None or v.start != 0 or v.size != n or v.stride != 1 for v, n in zip(view, ref.shape)):
        raise rc.error(
            "scratch Refs live in registers in the Triton backend and can only be read and "
            "written whole (ref[...]); index them after loading instead"
        )


def _unflatten_transforms(rc: RuleContext, idx_args, tree):
    return tree_util.tree_unflatten(tree, list(idx_args))


@register_lowering(compat.get_p)
def _get_rule(rc: RuleContext, ref, *idx, tree):
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    return _load_ref(rc, ref, view, rc.avals_out[0].dtype)


@register_lowering(compat.swap_p)
def _swap_rule(rc: RuleContext, ref, val, *idx, tree):
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = None
    if rc.lowering.is_used(rc.eqn.outvars[0]):
        old = _load_ref(rc, ref, view, rc.avals_out[0].dtype)
    _store_ref(rc, ref, view, val)
    return old if old is not None else Val("None", rc.avals_out[0].shape, rc.avals_out[0].dtype)


@register_lowering(compat.addupdate_p)
def _addupdate_rule(rc: RuleContext, ref, val, *idx, tree):
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = _load_ref(rc, ref, view, val.dtype)
    new = rc.em.assign(f"{old.expr} + {val.expr}", val.shape, val.dtype)
    _store_ref(rc, ref, view, new)
    return []


def _and_masks(*ms) -> str | None:
    ms = [m for m in ms if m]
    return " & ".join(f"({m})" for m in ms) if ms else None


def _gpu_access(rc: RuleContext, ref, tree, args, what: str):
    if not isinstance(ref, BlockRef):
        raise rc.error(f"plgpu.{what} works on input/output Refs, not on scratch Refs")
    n = tree.num_leaves
    view = _apply_indexers(ref, _unflatten_transforms(rc, args[:n], tree), rc)
    ptr, mask, shape = block_address(rc.em, ref, view)
    return ptr, mask, shape, list(args[n:])


@register_lowering(gpu_primitives.load_p)
def _plgpu_load_rule(
    rc: RuleContext, ref, *args, tree, has_mask, has_other, cache_modifier, eviction_policy, volatile
):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, "load")
    user_mask = rest.pop(0).expr if has_mask else None
    other = rest.pop(0).expr if has_other else "0"
    m = _and_masks(mask, user_mask)
    kw = ""
    if cache_modifier:
        kw += f", cache_modifier={cache_modifier!r}"
    if eviction_policy:
        kw += f", eviction_policy={eviction_policy!r}"
    if volatile:
        kw += ", volatile=True"
    expr = f"tl.load({ptr}, mask={m}, other={other}{kw})" if m else f"tl.load({ptr}{kw})"
    if is_bool(ref.dtype):
        expr = f"{expr} != 0"
    return rc.out(expr)


@register_lowering(gpu_primitives.store_p)
def _plgpu_store_rule(rc: RuleContext, ref, val, *args, tree, has_mask, eviction_policy):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, "store")
    m = _and_masks(mask, rest[0].expr if has_mask else None)
    x = f"{val.expr}.to(tl.int8)" if is_bool(ref.dtype) else val.expr
    kw = f", eviction_policy={eviction_policy!r}" if eviction_policy else ""
    rc.em.emit(f"tl.store({ptr}, {x}, mask={m}{kw})" if m else f"tl.store({ptr}, {x}{kw})")
    return []


@register_lowering(gpu_primitives.atomic_rmw_p)
def _plgpu_atomic_rule(rc: RuleContext, ref, val, *args, tree, has_mask, op):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, f"atomic_{op}")
    m = _and_masks(mask, rest[0].expr if has_mask else None)
    kw = f", mask={m}" if m else ""
    return rc.out(f"tl.atomic_{op}({ptr}, {val.expr}{kw})")


# ---------------------------------------------------------------------------
# Control flow


def _carry_vars(em: Emitter, vals: Sequence[Val], hint: str) -> list[Val]:
    """Fresh variables initialized to ``vals`` (loop-carried values)."""
    out = []
    for v in vals:
        if isinstance(v, (BlockRef, ScratchRef)):
            out.append(v)
        else:
            out.append(em.assign(v.expr, v.shape, v.dtype, hint))
    return out


def _reassign(em: Emitter, targets: Sequence[Val], values: Sequence[Val]) -> None:
    tmps = []
    for t, v in zip(targets, values):
        if isinstance(t, (BlockRef, ScratchRef)):
            continue
        tmp = em.fresh("t")
        em.emit(f"{tmp} = {v.expr}")
        tmps.append((t, tmp))
    for t, tmp in tmps:
        em.emit(f"{t.expr} = {tmp}")


@register_lowering(compat.scan_p)
def _scan_rule(rc: RuleContext, *args, jaxpr, length, **params):
    num_consts, num_carry = compat.scan_counts(params)
    if len(args) != num_consts + num_carry:
        raise rc.error(
            "lax.scan over arrays (xs/ys) is not supported inside Triton kernels; use "
            "lax.fori_loop and index Refs with pl.ds instead"
        )
    consts, init = args[:num_consts], args[num_consts:]
    em = rc.em
    carry = _carry_vars(em, init, "carry")
    it = em.fresh("it")
    with em.block(f"for {it} in range(0, {length}):"):
        outs = rc.lowering.lower_jaxpr(jaxpr, [*consts, *carry])
        _reassign(em, carry, outs)
    return carry


@register_lowering(compat.while_p)
def _while_rule(rc: RuleContext, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    cconsts = args[:cond_nconsts]
    bconsts = args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    em, kl = rc.em, rc.lowering
    carry = _carry_vars(em, init, "carry")
    (pred,) = kl.lower_jaxpr(cond_jaxpr, [*cconsts, *carry])
    p = em.assign(pred.expr, (), np.bool_, "pred")
    with em.block(f"while {p.expr}:"):
        outs = kl.lower_jaxpr(body_jaxpr, [*bconsts, *carry])
        _reassign(em, carry, outs)
        (pred,) = kl.lower_jaxpr(cond_jaxpr, [*cconsts, *carry])
        em.emit(f"{p.expr} = {pred.expr}")
    return carry


@register_lowering(compat.cond_p)
def _cond_rule(rc: RuleContext, index, *ops, branches, **_):
    em, kl = rc.em, rc.lowering
    if index.shape != ():
        raise rc.error("the predicate of lax.cond must be a scalar")
    outs = [em.fresh("r") for _ in rc.avals_out]
    results = [Val(o, a.shape, a.dtype) for o, a in zip(outs, rc.avals_out)]
    n = len(branches)
    for b, br in enumerate(branches):
        if n == 1:
            header = None
        elif b == 0:
            header = f"if {index.expr} <= 0:" if n > 2 else f"if {index.expr} == 0:"
        elif b == n - 1:
            header = "else:"
        else:
            header = f"elif {index.expr} == {b}:"
        with em.block(header) if header else _nullctx():
            vals = kl.lower_jaxpr(br, list(ops))
            for o, v in zip(outs, vals):
                em.emit(f"{o} = {v.expr}")
    return results


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _inline_rule(param: str):
    def rule(rc: RuleContext, *args, **params):
        return rc.lowering.lower_jaxpr(params[param], list(args))

    return rule


register_lowering(compat.jit_p)(_inline_rule("jaxpr"))
register_lowering(compat.custom_jvp_call_p)(_inline_rule("call_jaxpr"))
register_lowering(compat.custom_vjp_call_p)(_inline_rule("call_jaxpr"))


@register_lowering(pallas_backend.run_scoped_p)
def _run_scoped_rule(rc: RuleContext, *consts, jaxpr, num_consts):
    em = rc.em
    scratch = []
    for a in jaxpr.in_avals[num_consts:]:
        inner = a.inner_aval if hasattr(a, "inner_aval") else a
        v = const(em, 0, inner.dtype, inner.shape)
        scratch.append(ScratchRef(v.expr, tuple(inner.shape), np.dtype(inner.dtype)))
    return rc.lowering.lower_jaxpr(jaxpr, [*consts, *scratch])


@register_lowering(pallas_backend.multiple_of_p)
def _multiple_of_rule(rc: RuleContext, x, *, values):
    if x.shape == ():
        return rc.out(f"tl.multiple_of({x.expr}, {values[0]})")
    vals = list(values) if len(values) == len(x.shape) else [values[0]] * len(x.shape)
    return rc.out(f"tl.multiple_of({x.expr}, {vals})")


@register_lowering(pallas_backend.debug_print_p)
def _debug_print_rule(rc: RuleContext, *args, fmt):
    if fmt.count("{}") != len(args):
        raise rc.error("pl.debug_print in Triton kernels needs one '{}' per argument")
    pieces = fmt.split("{}")
    em = rc.em
    if not args:
        em.emit(f"tl.device_print({fmt!r})")
    for i, a in enumerate(args):
        prefix = pieces[i] if i else pieces[0]
        em.emit(f"tl.device_print({prefix!r}, {a.expr})")
    return []


# ---------------------------------------------------------------------------
# The kernel


def _as_closed(j):
    return j


class KernelLowering:
    """Lowers one kernel jaxpr and its grid mapping to Triton source."""

    def __init__(self, jaxpr, grid_mapping, name: str):
        self.jaxpr = jaxpr
        self.gm = grid_mapping
        self.name = name
        self.em = Emitter()
        self._used: set[int] = set()
        self._outer_eqns: list[Any] = []  # equations whose sub-jaxprs are being lowered

    def source_line(self, eqn) -> str:
        """The user's line of ``eqn``, else of the nearest enclosing equation
        (inside jnp functions' nested jits the line is often missing)."""
        for e in [eqn, *reversed(self._outer_eqns)]:
            line = compat.source_line(e)
            if line and line != "<unknown>":
                return line
        return f"the pallas_call at {self.gm.source}"

    # -- usage --
    def _collect_used(self, jaxpr) -> None:
        jaxpr, _ = compat.unwrap_jaxpr(jaxpr)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, compat.Var):
                    self._used.add(id(v))
            for p in eqn.params.values():
                for sub in _subjaxprs(p):
                    self._collect_used(sub)
        for v in jaxpr.outvars:
            if isinstance(v, compat.Var):
                self._used.add(id(v))

    def is_used(self, v) -> bool:
        return id(v) in self._used

    # -- jaxprs --
    def lower_jaxpr(self, closed, args: Sequence[Any]) -> list[Any]:
        jaxpr, consts = compat.unwrap_jaxpr(closed)
        env: dict[Any, Any] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self._const_val(c)
        for var, a in zip(jaxpr.invars, args):
            env[var] = a

        def read(v):
            if isinstance(v, compat.Literal):
                return self._const_val(v.val, v.aval)
            return env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            rule = lowering_rules.get(eqn.primitive)
            rc = RuleContext(self.em, eqn, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars], self)
            if rule is None:
                raise rc.error(
                    "has no Triton lowering (the supported primitives are listed in pallas-gpu's "
                    "README); rewrite the kernel without it, or run it with interpret=True"
                )
            self._outer_eqns.append(eqn)
            try:
                outs = rule(rc, *invals, **eqn.params)
            finally:
                self._outer_eqns.pop()
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, compat.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _const_val(self, value, aval=None) -> Val:
        arr = np.asarray(value)
        dtype = aval.dtype if aval is not None else arr.dtype
        if arr.shape != ():
            if arr.size and np.all(arr == arr.flat[0]):
                return const(self.em, arr.flat[0].item(), dtype, arr.shape)
            raise LoweringError(
                f"{BACKEND}: kernel '{self.name}' captures a non-uniform array constant of shape "
                f"{arr.shape}; pass it as a pallas_call input instead"
            )
        return const(self.em, arr.item(), dtype)

    # -- frame --
    def program_ids(self) -> tuple[list[Val], tuple[int, int, int]]:
        """Grid indices from Triton's launch axes, and the launch grid.

        The whole grid is folded onto axis 0 with the last grid axis varying
        fastest: that is Pallas' sequential order, so neighbouring programs
        share blocks as in a hand-written Triton kernel (and axis 0 takes
        2**31 - 1 programs, where axes 1 and 2 stop at 65535).
        """
        grid = self.gm.grid
        em = self.em
        total = math.prod(grid)
        if total > MAX_GRID_X:
            raise LoweringError(
                f"{BACKEND}: kernel '{self.name}': grid {grid} has {total} programs; Triton "
                f"launches at most {MAX_GRID_X}"
            )
        if not grid:
            return [], (1, 1, 1)
        em.emit("pid = tl.program_id(0)")
        ids: list[Val] = [None] * len(grid)  # type: ignore[list-item]
        rest = "pid"
        for ax in range(len(grid) - 1, -1, -1):
            g = grid[ax]
            name = f"pid{ax}"
            if ax == 0:
                em.emit(f"{name} = {rest}")
            elif g == 1:
                em.emit(f"{name} = tl.full([], 0, tl.int32)")
            else:
                em.emit(f"{name} = {rest} % {g}")
                em.emit(f"pid_rest{ax} = {rest} // {g}")
                rest = f"pid_rest{ax}"
            ids[ax] = Val(name, (), np.dtype(np.int32))
        return ids, (max(total, 1), 1, 1)

    def block_ref(self, i: int, bm, ids: list[Val]) -> BlockRef:
        em = self.em
        em.emit(
            f"# {bm.origin}: {bm.dtype}{list(bm.array_shape)}, block {tuple(str(d) for d in bm.block_shape)}"
        )
        idx = self.lower_jaxpr(bm.index_map, ids)
        starts, in_bounds, nonneg, kernel_dims = [], [], [], []
        for d, (dim, n) in enumerate(zip(bm.block_shape, bm.array_shape)):
            v = idx[d]
            ix = v.expr if v.static is None else int(v.static)
            if isinstance(dim, pallas_backend.Element):
                start = _add(ix, -dim.padding[0]) if dim.padding[0] else ix
                size = dim.block_size
                in_bounds.append(False)
                nonneg.append(dim.padding[0] == 0)
            else:
                size = 1 if isinstance(dim, pallas_backend.Squeezed) else dim.block_size
                start = _mul(ix, size)
                in_bounds.append(n % size == 0)
                nonneg.append(True)
            if not isinstance(start, int):
                name = em.fresh("start")
                em.emit(f"{name} = {start}")
                start = name
            starts.append(start)
            if not isinstance(dim, pallas_backend.Squeezed):
                kernel_dims.append(d)
        return BlockRef(
            f"{_arg_name(bm, i)}",
            tuple(bm.array_shape),
            np.dtype(bm.dtype),
            starts,
            kernel_dims,
            tuple(bm.kernel_block_shape),
            in_bounds,
            nonneg,
        )

    def lower(self) -> tuple[str, list[str], tuple[int, int, int]]:
        """Returns (kernel source, pointer signature per argument, launch grid)."""
        self._collect_used(self.jaxpr)
        gm = self.gm
        em = self.em
        ids, launch_grid = self.program_ids()
        refs: list[Any] = [self.block_ref(i, bm, ids) for i, bm in enumerate(gm.block_mappings)]
        for a in gm.scratch_avals:
            inner = a.inner_aval if hasattr(a, "inner_aval") else a
            v = const(em, 0, inner.dtype, inner.shape)
            refs.append(ScratchRef(v.expr, tuple(inner.shape), np.dtype(inner.dtype)))
        em.emit("# kernel body")
        self.lower_jaxpr(self.jaxpr, [*ids, *refs])
        args = [_arg_name(bm, i) for i, bm in enumerate(gm.block_mappings)]
        sig = [pointer_signature(bm.dtype) for bm in gm.block_mappings]
        header = [f"def {self.name}({', '.join(args)}):"]
        return "\n".join(header + em.lines) + "\n", sig, launch_grid


def _arg_name(bm, i: int) -> str:
    return f"in{i}_ptr" if bm.origin.startswith("in") else f"out{i}_ptr"


def _subjaxprs(p):
    if isinstance(p, (compat.ClosedJaxpr, compat.Jaxpr)):
        yield p
    elif isinstance(p, (tuple, list)):
        for q in p:
            yield from _subjaxprs(q)


PREAMBLE_GPU = """from triton.language.extra import libdevice


@triton.jit
def _dot_operand(x):
    return x
"""
# Triton's interpreter holds bf16 as raw uint16 and multiplies those bits in
# tl.dot; products of bf16 values are exact in f32, so widen them there.
PREAMBLE_INTERPRET = """from pallas_gpu._src.interpret_libdevice import libdevice


@triton.jit
def _dot_operand(x):
    return x.to(tl.float32) if x.dtype == tl.bfloat16 else x
"""


@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    """The generated kernel: module source (without the libdevice import
    line, which differs between GPU and interpreter), its name, pointer
    signature and launch grid."""

    name: str
    body: str
    signature: tuple[str, ...]
    launch_grid: tuple[int, int, int]

    def module_source(self, interpret: bool) -> str:
        pre = "import triton\nimport triton.language as tl\n"
        pre += PREAMBLE_INTERPRET if interpret else PREAMBLE_GPU
        return pre + "\n\n" + self.body


def kernel_name(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "kernel"
    if out[0].isdigit():
        out = "k_" + out
    return out


def lower_kernel(jaxpr, grid_mapping) -> LoweredKernel:
    from pallas_gpu._src import lowering_math  # noqa: F401  (registers math rules)

    name = kernel_name(grid_mapping.kernel_name)
    kl = KernelLowering(jaxpr, grid_mapping, name)
    src, sig, launch_grid = kl.lower()
    helpers = "".join(f"@triton.jit\n{s}\n\n" for s in kl.em.helpers.values())
    body = helpers + "@triton.jit\n" + src
    return LoweredKernel(name, body, tuple(sig), launch_grid)
