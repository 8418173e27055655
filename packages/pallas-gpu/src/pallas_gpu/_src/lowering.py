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

This file holds the value model, the emitter and the kernel frame. The rules
live by theme: ``lowering_memory.py`` (Ref reads/writes, block addressing,
``plgpu.load/store`` and atomics), ``lowering_control.py`` (loops, cond,
inlined calls, scoped scratch), ``lowering_math.py`` (elementwise math and
casts) and ``lowering_shapes.py`` (shapes, reductions, scans and dots).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_gpu._src import compat

BACKEND = "pallas_gpu (Triton)"
# Triton's launch-grid limits per axis.
MAX_GRID_X = 2**31 - 1
# Triton's largest tensor (triton.language.TRITON_MAX_TENSOR_NUMEL).
MAX_TENSOR_NUMEL = 2**20


def next_pow2(n: int) -> int:
    n = int(n)
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
# The kernel


class KernelLowering:
    """Lowers one kernel jaxpr and its grid mapping to Triton source."""

    def __init__(self, jaxpr, grid_mapping, name: str):
        self.jaxpr = jaxpr
        self.gm = grid_mapping
        self.name = name
        self.em = Emitter()
        self._used: set[int] = set()
        self._outer_eqns: list[Any] = []  # equations whose sub-jaxprs are being lowered
        self.gpu_only: list[str] = []  # uses that Triton's interpreter cannot run (inline PTX)

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
            self._check_result(rc)
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

    def _check_result(self, rc: RuleContext) -> None:
        """Results Triton cannot hold: too many elements, or a dtype it lacks."""
        for a in rc.avals_out:
            dtype = getattr(a, "dtype", None)
            if dtype is not None and not compat.is_ref_aval(a) and np.dtype(dtype).name not in _DTYPES:
                raise rc.error(f"dtype {np.dtype(dtype).name} is not supported by Triton")
            shape = tuple(getattr(a, "shape", ()))
            numel = math.prod(pad_shape(shape))
            if numel > MAX_TENSOR_NUMEL:
                padded = f" (padded to {pad_shape(shape)})" if pad_shape(shape) != shape else ""
                raise rc.error(
                    f"its result of shape {shape}{padded} has {numel} elements, and Triton tensors hold "
                    f"at most 2**20 = {MAX_TENSOR_NUMEL}; use a smaller block shape in the BlockSpec, or "
                    "read the block in pieces (x_ref[pl.ds(i * n, n), :] in a loop)"
                )

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

    def lower(self) -> tuple[str, list[str], tuple[int, int, int]]:
        """Returns (kernel source, pointer signature per argument, launch grid)."""
        from pallas_gpu._src.lowering_memory import block_ref

        self._collect_used(self.jaxpr)
        gm = self.gm
        em = self.em
        ids, launch_grid = self.program_ids()
        refs: list[Any] = [block_ref(self, i, bm, ids) for i, bm in enumerate(gm.block_mappings)]
        for a in gm.scratch_avals:
            inner = a.inner_aval if hasattr(a, "inner_aval") else a
            v = const(em, 0, inner.dtype, inner.shape)
            refs.append(ScratchRef(v.expr, tuple(inner.shape), np.dtype(inner.dtype)))
        em.emit("# kernel body")
        self.lower_jaxpr(self.jaxpr, [*ids, *refs])
        args = [arg_name(bm, i) for i, bm in enumerate(gm.block_mappings)]
        sig = [pointer_signature(bm.dtype) for bm in gm.block_mappings]
        header = [f"def {self.name}({', '.join(args)}):"]
        return "\n".join(header + em.lines) + "\n", sig, launch_grid


def arg_name(bm, i: int) -> str:
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


@triton.jit
def _approx_tanh(x):
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _loop_bound(x):
    return x
"""
# Triton's interpreter holds bf16 as raw uint16 and multiplies those bits in
# tl.dot; products of bf16 values are exact in f32, so widen them there.
PREAMBLE_INTERPRET = """from pallas_gpu._src.interpret_libdevice import libdevice


@triton.jit
def _dot_operand(x):
    return x.to(tl.float32) if x.dtype == tl.bfloat16 else x


@triton.jit
def _approx_tanh(x):
    return libdevice.tanh(x)


def _loop_bound(x):
    # The interpreter's scalars hold a 1-element array, which range() cannot take.
    return int(x.handle.data.reshape(-1)[0]) if hasattr(x, "handle") else int(x)
"""


@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    """The generated kernel: module source (without the libdevice import
    line, which differs between GPU and interpreter), its name, pointer
    signature and launch grid. ``gpu_only`` lists the uses (with their
    source lines) that Triton's interpreter cannot run."""

    name: str
    body: str
    signature: tuple[str, ...]
    launch_grid: tuple[int, int, int]
    gpu_only: tuple[str, ...] = ()

    def module_source(self, interpret: bool) -> str:
        if interpret and self.gpu_only:
            raise NotImplementedError(
                f"{BACKEND}: kernel '{self.name}' uses {', '.join(self.gpu_only)}: inline PTX cannot "
                "run under Triton's CPU interpreter; run the kernel on the GPU (without "
                "interpret=plgpu.InterpretParams())"
            )
        pre = "import triton\nimport triton.language as tl\n"
        pre += PREAMBLE_INTERPRET if interpret else PREAMBLE_GPU
        return pre + "\n\n" + self.body


def kernel_name(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "kernel"
    if out[0].isdigit():
        out = "k_" + out
    return out


def lower_kernel(jaxpr, grid_mapping) -> LoweredKernel:
    # The rule modules register themselves in ``lowering_rules`` on import.
    from pallas_gpu._src import lowering_control, lowering_math, lowering_memory, lowering_shapes  # noqa: F401

    name = kernel_name(grid_mapping.kernel_name)
    kl = KernelLowering(jaxpr, grid_mapping, name)
    src, sig, launch_grid = kl.lower()
    helpers = "".join(f"@triton.jit\n{s}\n\n" for s in kl.em.helpers.values())
    body = helpers + "@triton.jit\n" + src
    return LoweredKernel(name, body, tuple(sig), launch_grid, tuple(kl.gpu_only))
