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

This file holds the value model, the emitter, the rule table and the
``KernelFrame`` protocol (what a rule sees of the kernel being lowered); it
imports no other lowering module. The rules live by theme and import only this
file (and the addressing helpers of ``address.py``, which hold no rules):
``memory.py`` (Ref reads/writes, block loads and stores, ``plgpu.load/store``
and atomics), ``control.py`` (loops, cond, inlined calls, scoped scratch),
``math.py`` (elementwise math and casts) and ``shapes.py`` (shapes, reductions,
scans and dots). The kernel frame (grid, block Refs, the walk over the jaxpr)
is ``kernel.py``'s ``KernelLowering``, which imports all of them and implements
``KernelFrame``: the rule modules depend on the protocol, never on the frame.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np

from pallas import backend as plb
from pallas import next_power_of_2

BACKEND = "pallas_gpu (Triton)"
# Triton's launch-grid limits per axis.
MAX_GRID_X = 2**31 - 1
# Triton's largest tensor (triton.language.TRITON_MAX_TENSOR_NUMEL).
MAX_TENSOR_NUMEL = 2**20


def next_pow2(n: int) -> int:
    """``pl.next_power_of_2`` of a dim (a Python or numpy int)."""
    return next_power_of_2(int(n))


def pad_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(next_pow2(d) for d in shape)


# numpy dtype -> (triton.language name, signature name of a pointer to it).
DTYPES = {
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
    # 4-bit ints are held in a byte in registers (Triton has no 4-bit type);
    # in memory XLA packs them two per byte, read through *u8 pointers.
    "int4": ("tl.int8", "u8"),
    "uint4": ("tl.uint8", "u8"),
}
INT4 = ("int4", "uint4")


def int_range(dtype) -> tuple[int, int]:
    name = np.dtype(dtype).name
    if name in INT4:
        return (-8, 7) if name == "int4" else (0, 15)
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def tl_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise NotImplementedError(f"{BACKEND}: dtype {name} is not supported by Triton")
    return DTYPES[name][0]


def pointer_signature(dtype: Any) -> str:
    return "*" + DTYPES[np.dtype(dtype).name][1]


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
class ResidentRef(ScratchRef):
    """An output block kept in registers across the steps of sequential grid
    axes (see ``kernel.py``): read and written whole like a scratch
    Ref; ``block`` is where it is loaded from and stored back to."""

    index: int = -1
    block: BlockRef | None = None


class NotResident(Exception):
    """Raised by a rule that needs output ``index`` in memory (a partial or
    ``plgpu`` access): the kernel is lowered again with that block in memory."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


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


class KernelFrame(Protocol):
    """What a rule sees of the kernel being lowered (``RuleContext.lowering``):
    ``kernel.py``'s ``KernelLowering`` implements it."""

    em: Emitter  # the kernel body's emitter
    gm: Any  # the grid mapping
    name: str  # the user's name of the kernel, for messages
    use_tma: bool  # block Ref accesses through TMA tensor descriptors (CompilerParams)
    warp_specialize: bool  # warp-specialized outermost loops (CompilerParams)
    loop_depth: int  # fori loops being lowered around the current equation
    grid_ids: list[Val]  # the grid index of each axis (lax.axis_index of a named grid)
    gpu_only: list[str]  # uses that Triton's interpreter cannot run (inline PTX), with their lines

    def source_line(self, eqn: Any) -> str:
        """The user's line of ``eqn`` (or of the nearest enclosing equation)."""
        ...

    def lower_jaxpr(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """Lowers a (closed) jaxpr on ``args`` in place; its results."""
        ...

    def is_used(self, v: Any) -> bool:
        """Whether the jaxpr variable ``v`` is read anywhere in the kernel."""
        ...

    def tma_descriptor(self, ptr: str, array_shape: Any, block_shape: Any) -> str:
        """The variable of a TMA tensor descriptor for ``ptr`` (made once, at the top)."""
        ...


@dataclasses.dataclass
class RuleContext:
    em: Emitter
    eqn: Any
    avals_in: Sequence[Any]
    avals_out: Sequence[Any]
    lowering: KernelFrame

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
lowering_rules = plb.RuleTable(BACKEND)
register_lowering = lowering_rules.register


def lower_fun(fn: Callable[..., Any], rc: RuleContext, *args: Val, multiple_results: bool = False, **params):
    """Lowers a composite op through its ``jnp`` definition ``fn(*args, **params)``
    (traced on the equation's input avals) and the existing rules."""
    jaxpr = plb.trace_composite(fn, rc.avals_in, rc.eqn.primitive.name, **params)
    outs = rc.lowering.lower_jaxpr(jaxpr, args)
    return outs if multiple_results else outs[0]


# ---------------------------------------------------------------------------
# Constants, casts and padding helpers used by rules


def const(em: Emitter, value: Any, dtype, shape=()) -> Val:
    """A tensor constant of exactly ``dtype`` (Python literals would be
    constexprs with Triton's own promotion rules)."""
    dtype = np.dtype(dtype)
    if is_bool(dtype):
        lit = "1" if bool(value) else "0"
    elif is_float(dtype):
        f = float(value)
        lit = (
            "float('nan')"
            if math.isnan(f)
            else ("float('inf')" if f == math.inf else ("float('-inf')" if f == -math.inf else repr(f)))
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


def uninitialized(em: Emitter, shape, dtype) -> Val:
    """A fresh scratch Ref's contents: what memory nothing has written holds on
    every engine (``plb.uninitialized_fill``: NaN, the smallest int, False), so
    that a read before the first write shows, on the GPU as under the interpreter."""
    return const(em, plb.uninitialized_fill(dtype).item(), dtype, shape)


def cast(em: Emitter, x: Val, dtype) -> Val:
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if is_bool(dtype):
        zero = const(em, 0, x.dtype)
        return em.assign(f"{x.expr} != {zero.expr}", x.shape, dtype)
    if is_float(x.dtype) and not is_float(dtype):
        return _float_to_int(em, x, dtype)
    if dtype.name in INT4:  # wrap into 4 bits, as XLA's integer narrowing does
        w = f"{x.expr}.to(tl.int32)"
        w = f"(({w} << 28) >> 28)" if dtype.name == "int4" else f"({w} & 15)"
        return em.assign(f"{w}.to({tl_dtype(dtype)})", x.shape, dtype)
    return em.assign(f"{x.expr}.to({tl_dtype(dtype)})", x.shape, dtype)


def _float_to_int(em: Emitter, x: Val, dtype: np.dtype) -> Val:
    """XLA's saturating conversion: NaN -> 0, out-of-range values -> the
    nearest end of the integer range (a bare ``.to`` gives INT_MIN for them
    under Triton's interpreter and wraps for 8/16-bit ints on the GPU)."""
    if x.dtype.itemsize < 4:
        x = em.assign(f"{x.expr}.to(tl.float32)", x.shape, np.float32)
    (imin, imax), ftype = int_range(dtype), x.dtype.type
    top = ftype(imax) + ftype(1)  # 2**bits or 2**(bits - 1): exact in floats
    lo, hi = const(em, imin, x.dtype), const(em, np.nextafter(top, ftype(0)), x.dtype)
    zero, c_top = const(em, 0, x.dtype), const(em, top, x.dtype)
    inside = (
        f"tl.where({x.expr} != {x.expr}, {zero.expr}, tl.minimum(tl.maximum({x.expr}, {lo.expr}), {hi.expr}))"
    )
    v = em.assign(f"{inside}.to({tl_dtype(dtype)})", x.shape, dtype)
    return em.assign(
        f"tl.where({x.expr} >= {c_top.expr}, {const(em, imax, dtype).expr}, {v.expr})", x.shape, dtype
    )


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


def arg_name(bm, i: int) -> str:
    return f"in{i}_ptr" if bm.origin.startswith("in") else f"out{i}_ptr"


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
PREAMBLE_INTERPRET = """from pallas_gpu._src.interpret.libdevice import libdevice


@triton.jit
def _dot_operand(x):
    return x.to(tl.float32) if x.dtype == tl.bfloat16 else x


@triton.jit
def _approx_tanh(x):
    return libdevice.tanh(x)


def _loop_bound(x):
    # The interpreter's scalars hold a 1-element array, which range() cannot take;
    # the interpreter's patched __index__ converts it (and, in a batched pass of
    # programs, checks that every program has the same bound).
    return x.__index__() if hasattr(x, "handle") else int(x)
"""


@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    """The generated kernel: module source (without the libdevice import
    line, which differs between GPU and interpreter), the name of its Triton
    function, pointer signature and launch grid. ``gpu_only`` lists the uses
    (with their source lines) that Triton's interpreter cannot run;
    ``kernel_name`` is the user's name of the kernel (for messages)."""

    name: str
    body: str
    signature: tuple[str, ...]
    launch_grid: tuple[int, int, int]
    gpu_only: tuple[str, ...] = ()
    kernel_name: str = ""
    source_options: tuple[tuple[str, bool], ...] = ()  # CompilerParams.source_options it was made with

    def module_source(self, interpret: bool) -> str:
        if interpret and self.gpu_only:
            raise NotImplementedError(
                f"{BACKEND}: kernel '{self.kernel_name or self.name}' uses {', '.join(self.gpu_only)}: inline PTX cannot "
                "run under Triton's CPU interpreter; run the kernel on the GPU (without "
                "interpret=plgpu.InterpretParams())"
            )
        pre = "import triton\nimport triton.language as tl\n"
        pre += PREAMBLE_INTERPRET if interpret else PREAMBLE_GPU
        return pre + "\n\n" + self.body
