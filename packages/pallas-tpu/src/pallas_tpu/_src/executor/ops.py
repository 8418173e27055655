"""The op table of ``run_mosaic`` (see ``run.py``): one rule per MLIR op
name, ``rule(ex, op, vals) -> list of results``, on NumPy values. Elementwise
ops come from tables; float math on 16-bit floats runs in float32 and is
rounded to the result type, as a TPU's VPU does on chips without bf16 math."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np


class MosaicError(RuntimeError):
    """A Mosaic module did something a TPU cannot (out-of-bounds access, a
    semaphore wait that never returns), or something ``run_mosaic`` lacks."""


@dataclasses.dataclass
class Buffer:
    """A memref: a NumPy view and its memory space (``vmem``, ``smem``,
    ``any``/``hbm``, ``semaphore_mem``). Semaphore memrefs hold int64 counts.
    ``key`` names the allocation the view is part of, the same on every device
    (a window, a scratch operand, an alloca), and ``root`` is that
    allocation's array on this device: a remote DMA or signal reaches the
    same part of the same allocation on another device (``on``).

    ``padded``, where set, is the tile-padded storage whose corner
    ``[:n0, :n1, ...]`` is ``array``: a kernel argument (an HBM array or a
    whole-array VMEM window) is stored padded to its memory tiling, as
    Mosaic's ``infer-memref-layout`` lays it out, and ``tpu.memref_slice``
    may cut into that padding (see ``memory.tiled_shape``)."""

    array: np.ndarray
    space: str
    is_semaphore: bool = False
    key: Any = None
    root: np.ndarray | None = None
    padded: np.ndarray | None = None

    def view(self, array) -> Buffer:
        return Buffer(array, self.space, self.is_semaphore, self.key, self.root)

    def on(self, mesh: Mesh, device: int) -> Buffer:
        """This view of the same allocation on ``device``."""
        other = mesh.root(device, self.key)
        offset = self.array.__array_interface__["data"][0] - self.root.__array_interface__["data"][0]
        arr = np.ndarray(
            self.array.shape, self.array.dtype, buffer=other, offset=offset, strides=self.array.strides
        )
        return Buffer(arr, self.space, self.is_semaphore, self.key, other)


class Mesh:
    """The devices of one ``run_mosaic`` call: each device's allocations by
    key, and one condition variable for semaphores. Devices run in threads; a
    wait blocks until its semaphore holds enough, and is a deadlock error when
    no running device can signal it any more.

    The devices form a mesh of ``shape`` (1-D: ``(num_devices,)``). A device
    is named by its logical id, its position in the mesh in row-major order:
    what ``tpu.device_id`` gives and what a remote DMA or signal's
    ``device_id`` operand takes (a kernel's ``DeviceIdType.MESH`` coordinates
    are flattened to it by the lowering, ours and JAX's)."""

    def __init__(
        self,
        num_devices: int,
        timeout: float = 60.0,
        shape: tuple[int, ...] | None = None,
        num_cores: int = 1,
    ):
        import threading

        self.shape = tuple(shape) if shape is not None else (num_devices,)
        if int(np.prod(self.shape)) != num_devices:
            raise ValueError(f"run_mosaic: a mesh of shape {self.shape} does not have {num_devices} devices")
        self.num_devices = num_devices
        # Each device runs num_cores TensorCores; a "unit" (device * num_cores + core)
        # is one running core, with its own allocations (the cores of a device share
        # the HBM arrays: the same array is registered for each of them).
        self.num_cores = num_cores
        self.num_units = num_devices * num_cores
        self.cv = threading.Condition()
        self.roots: list[dict[Any, np.ndarray]] = [{} for _ in range(self.num_units)]
        self.blocked: dict[int, tuple[Callable[[], bool], str]] = {}
        self.done: set[int] = set()
        self.error: str | None = None
        self.timeout = timeout

    def register(self, device: int, key, array: np.ndarray) -> None:
        with self.cv:
            self.roots[device][key] = array
            self.cv.notify_all()

    def name(self, unit: int) -> str:
        """``device 3``, with its mesh coordinates on an N-D mesh; with two or
        more cores ``core 1`` (one device) or ``device 3, core 1``."""
        device, core = divmod(unit, self.num_cores)
        if self.num_cores == 1:
            return self._device_name(device)
        if self.num_devices == 1:
            return f"core {core}"
        return f"{self._device_name(device)}, core {core}"

    def check_device(self, device: int) -> None:
        if not 0 <= device < self.num_devices:
            mesh = f"mesh of shape {self.shape}: " if len(self.shape) > 1 else ""
            raise MosaicError(
                f"run_mosaic: device id {device} is outside the {mesh}{self.num_devices} devices "
                f"(ids 0..{self.num_devices - 1})"
            )

    def _device_name(self, device: int) -> str:
        if len(self.shape) == 1:
            return f"device {device}"
        coords = tuple(int(c) for c in np.unravel_index(device, self.shape))
        return f"device {device} (mesh coordinates {coords})"

    def root(self, device: int, key) -> np.ndarray:
        """The allocation ``key`` of unit ``device`` (a device and core)."""
        if not 0 <= device < self.num_units:
            self.check_device(device // self.num_cores)
        with self.cv:
            self.wait(device, lambda: key in self.roots[device], f"allocating {key}", who=None)
            return self.roots[device][key]

    def fail(self, msg: str) -> MosaicError:
        with self.cv:
            if self.error is None:
                self.error = msg
            self.cv.notify_all()
        return MosaicError(msg)

    def wait(self, device, pred, desc: str, who=-1) -> None:
        """Blocks (``cv`` held) until ``pred()``; ``who`` is the waiting device
        (``None``: a lookup on behalf of another device, never a deadlock)."""
        import time

        deadline = time.monotonic() + self.timeout
        while not pred():
            if self.error is not None:
                raise MosaicError(f"run_mosaic: stopped because another device failed: {self.error}")
            if who is not None:
                self.blocked[who] = (pred, desc)
                self.cv.notify_all()
                if all(
                    d in self.done or (d in self.blocked and not self.blocked[d][0]())
                    for d in range(self.num_units)
                ):
                    others = "; ".join(
                        self.blocked[d][1] if d in self.blocked else f"{self.name(d)} finished"
                        for d in range(self.num_units)
                        if d != who
                    )
                    raise self.fail(f"run_mosaic: deadlock: {desc}" + (f" ({others})" if others else ""))
            if time.monotonic() > deadline:
                raise self.fail(f"run_mosaic: {desc}: still waiting after {self.timeout:g} s")
            self.cv.wait(0.05)
        if who is not None:
            self.blocked.pop(who, None)


_DTYPES = {
    "f32": np.float32,
    "f64": np.float64,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "index": np.int64,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "i4": ml_dtypes.int4,
}
_UNSIGNED = {
    np.dtype(np.int8): np.uint8,
    np.dtype(np.int16): np.uint16,
    np.dtype(np.int32): np.uint32,
    np.dtype(np.int64): np.uint64,
}


def element_type(t) -> str:
    from jaxlib.mlir import ir

    if isinstance(t, ir.ShapedType):
        return str(ir.ShapedType(t).element_type)
    return str(t)


def np_dtype(t) -> np.dtype:
    name = element_type(t)
    if name not in _DTYPES:
        raise MosaicError(f"run_mosaic: element type {name} is not supported")
    return np.dtype(_DTYPES[name])


def shape_of(t) -> tuple[int, ...]:
    from jaxlib.mlir import ir

    return tuple(ir.ShapedType(t).shape) if isinstance(t, ir.ShapedType) else ()


def memory_space(mt) -> str:
    ms = mt.memory_space
    if ms is None:
        return "any"
    return enum_attr(ms)


def uninitialized(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating) or dtype in (np.dtype(ml_dtypes.bfloat16),):
        return np.full(shape, np.nan, dtype)
    return np.zeros(shape, dtype)


def allocate(t, key=None) -> Buffer:
    """A fresh buffer for a memref type (scratch operands, allocas)."""
    from jaxlib.mlir import ir

    mt = ir.MemRefType(t)
    if "semaphore" in element_type(t):
        arr = np.zeros(tuple(mt.shape), np.int64)
        return Buffer(arr, "semaphore_mem", True, key, arr)
    arr = uninitialized(tuple(mt.shape), np_dtype(t))
    return Buffer(arr, memory_space(mt), False, key, arr)


def where(op) -> str:
    loc = str(op.location)
    return f"'{op.operation.name}' at {loc}"


# ---------------------------------------------------------------------------
# The executor: regions, blocks, values.


class Executor:
    """Runs one core's kernel: ``device`` is its unit of ``mesh`` (device id
    ``chip``, core ``core``)."""

    def __init__(self, funcs: dict[str, Any], mesh: Mesh, device: int):
        self.funcs = funcs
        self.mesh = mesh
        self.device = device
        self.chip, self.core = divmod(device, mesh.num_cores)
        self.allocations: dict[Any, int] = {}
        self.iteration_bounds: list[int] = []  # the grid (dynamic sizes filled in), for tpu.iteration_bound

    def allocate(self, op) -> Buffer:
        """A buffer for an alloca op; its key is the op and how many times this
        device ran it (so devices running the same code agree on keys)."""
        site = (str(op.location), str(op.operation.results[0].type))
        n = self.allocations.get(site, 0)
        self.allocations[site] = n + 1
        buf = allocate(op.operation.results[0].type, ("alloca", site, n))
        self.mesh.register(self.device, buf.key, buf.root)
        return buf

    def call(self, func, args) -> list[Any]:
        with np.errstate(all="ignore"):
            return self.region(func.regions[0], args, {})

    def region(self, region, args, env) -> list[Any]:
        """Runs the region's entry block; returns its terminator's operands."""
        block = region.blocks[0]
        for a, v in zip(block.arguments, args):
            env[a] = v
        for op in block.operations:
            name = op.operation.name
            vals = [env[v] for v in op.operation.operands]
            if name in _TERMINATORS:
                return vals
            rule = RULES.get(name)
            if rule is None:
                raise MosaicError(f"run_mosaic: op {where(op)} is not supported")
            outs = rule(self, op, vals, env)
            for r, v in zip(op.operation.results, outs or ()):
                env[r] = v
        return []


_TERMINATORS = {"func.return", "scf.yield", "tpu.yield", "scf.condition"}
RULES: dict[str, Callable[..., list[Any] | None]] = {}


def rule(*names):
    def register(fn):
        for n in names:
            RULES[n] = fn
        return fn

    return register


def _out_dtype(op, i=0) -> np.dtype:
    return np_dtype(op.operation.results[i].type)


def _cast(x, op, i=0):
    return np.asarray(x).astype(_out_dtype(op, i))


def _f32(x):
    x = np.asarray(x)
    return (
        x.astype(np.float32)
        if x.dtype.itemsize < 4 and x.dtype.kind in "fV" or x.dtype == ml_dtypes.bfloat16
        else x
    )


def _unsigned(x):
    x = np.asarray(x)
    return x.view(_UNSIGNED[x.dtype]) if x.dtype in _UNSIGNED else x


# -- constants ---------------------------------------------------------------


@rule("arith.constant")
def _constant(ex, op, vals, env):
    from jaxlib.mlir import ir

    attr = op.attributes["value"]
    t = op.operation.results[0].type
    dtype, shape = np_dtype(t), shape_of(t)
    if isinstance(attr, ir.DenseElementsAttr):
        d = ir.DenseElementsAttr(attr)
        if d.is_splat:
            return [np.full(shape, _scalar(d.get_splat_value()), dtype)]
        return [np.array(d).astype(dtype).reshape(shape)]
    return [np.array(_scalar(attr), dtype)]


def _scalar(attr):
    from jaxlib.mlir import ir

    if isinstance(attr, ir.BoolAttr):
        return ir.BoolAttr(attr).value
    if isinstance(attr, ir.IntegerAttr):
        v = ir.IntegerAttr(attr).value
        return bool(v) if isinstance(attr.type, ir.IntegerType) and attr.type.width == 1 else v
    if isinstance(attr, ir.FloatAttr):
        return ir.FloatAttr(attr).value
    if isinstance(attr, ir.BoolAttr):
        return ir.BoolAttr(attr).value
    raise MosaicError(f"run_mosaic: constant {attr} is not supported")


# -- elementwise -------------------------------------------------------------


def _trunc_div(a, b):
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)  # INT_MIN / -1 wraps when cast back
    b_safe = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(b_safe)
    q = np.where((a < 0) != (b_safe < 0), -q, q)
    return np.where(b == 0, -1, q)


def _shift(fn, a, b):
    bits = np.asarray(a).dtype.itemsize * 8
    ok = (b >= 0) & (b < bits)
    return np.where(ok, fn(a, np.where(ok, b, 0).astype(np.asarray(a).dtype)), 0)


_BINARY_INT = {
    "arith.addi": np.add,
    "arith.subi": np.subtract,
    "arith.muli": np.multiply,
    "arith.divsi": _trunc_div,
    "arith.remsi": lambda a, b: np.where(b == 0, a, np.asarray(a, np.int64) - _trunc_div(a, b) * b),
    "arith.floordivsi": lambda a, b: np.floor_divide(a, np.where(b == 0, 1, b)),
    "arith.maxsi": np.maximum,
    "arith.minsi": np.minimum,
    "arith.andi": np.bitwise_and,
    "arith.ori": np.bitwise_or,
    "arith.xori": np.bitwise_xor,
    "arith.shli": lambda a, b: _shift(np.left_shift, a, b),
    "arith.shrsi": lambda a, b: np.right_shift(a, np.clip(b, 0, np.asarray(a).dtype.itemsize * 8 - 1)),
}
_BINARY_UNSIGNED = {
    "arith.divui": lambda a, b: np.where(b == 0, np.iinfo(a.dtype).max, a // np.where(b == 0, 1, b)),
    "arith.remui": lambda a, b: np.where(b == 0, a, a % np.where(b == 0, 1, b)),
    "arith.maxui": np.maximum,
    "arith.minui": np.minimum,
    "arith.shrui": lambda a, b: _shift(np.right_shift, a, b),
}
_BINARY_FLOAT = {
    "arith.addf": np.add,
    "arith.subf": np.subtract,
    "arith.mulf": np.multiply,
    "arith.divf": np.divide,
    "arith.remf": np.fmod,
    "arith.maximumf": np.maximum,
    "arith.minimumf": np.minimum,
    "arith.maxnumf": np.fmax,
    "arith.minnumf": np.fmin,
    "math.powf": np.power,
    "math.atan2": np.arctan2,
    "math.copysign": np.copysign,
}


def _erf(x):
    import jax

    return np.asarray(jax.lax.erf(np.asarray(x, np.float32)))


_UNARY_FLOAT = {
    "arith.negf": np.negative,
    "math.exp": np.exp,
    "math.exp2": np.exp2,
    "math.expm1": np.expm1,
    "math.log": np.log,
    "math.log1p": np.log1p,
    "math.log2": np.log2,
    "math.log10": np.log10,
    "math.sqrt": np.sqrt,
    "math.rsqrt": lambda x: 1 / np.sqrt(x),
    "math.cbrt": np.cbrt,
    "math.tanh": np.tanh,
    "math.sin": np.sin,
    "math.cos": np.cos,
    "math.tan": np.tan,
    "math.asin": np.arcsin,
    "math.acos": np.arccos,
    "math.atan": np.arctan,
    "math.sinh": np.sinh,
    "math.cosh": np.cosh,
    "math.asinh": np.arcsinh,
    "math.acosh": np.arccosh,
    "math.atanh": np.arctanh,
    "math.absf": np.abs,
    "math.floor": np.floor,
    "math.ceil": np.ceil,
    "math.roundeven": np.rint,
    "math.round": lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5),
    "math.trunc": np.trunc,
    "math.erf": _erf,
    "tpu.reciprocal": lambda x: 1 / x,
    "tpu.logistic": lambda x: 1 / (1 + np.exp(-x)),
}
_UNARY_INT = {
    "math.absi": np.abs,
    "math.ctpop": lambda x: np.bitwise_count(_unsigned(x)).astype(np.asarray(x).dtype),
}
_PREDICATES_I = ["eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge"]
_CMP = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}
_PREDICATES_F = [
    "false",
    "oeq",
    "ogt",
    "oge",
    "olt",
    "ole",
    "one",
    "ord",
    "ueq",
    "ugt",
    "uge",
    "ult",
    "ule",
    "une",
    "uno",
    "true",
]


def _binary(fn, prep=lambda x: x):
    def r(ex, op, vals, env):
        a, b = (prep(v) for v in vals)
        return [_cast(fn(a, b), op)]

    return r


for _n, _f in _BINARY_INT.items():
    RULES[_n] = _binary(_f)
for _n, _f in _BINARY_UNSIGNED.items():
    RULES[_n] = (lambda f: lambda ex, op, vals, env: [f(*(_unsigned(v) for v in vals)).view(_out_dtype(op))])(
        _f
    )
for _n, _f in _BINARY_FLOAT.items():
    RULES[_n] = _binary(_f, _f32)
for _n, _f in _UNARY_FLOAT.items():
    RULES[_n] = (lambda f: lambda ex, op, vals, env: [_cast(f(_f32(vals[0])), op)])(_f)
for _n, _f in _UNARY_INT.items():
    RULES[_n] = (lambda f: lambda ex, op, vals, env: [_cast(f(vals[0]), op)])(_f)


@rule("math.fma")
def _fma(ex, op, vals, env):
    a, b, c = (_f32(v) for v in vals)
    return [_cast(a * b + c, op)]


@rule("math.isnan", "math.isinf", "math.isfinite")
def _isclass(ex, op, vals, env):
    fn = {"math.isnan": np.isnan, "math.isinf": np.isinf, "math.isfinite": np.isfinite}[op.operation.name]
    return [fn(_f32(vals[0]))]


@rule("arith.cmpi")
def _cmpi(ex, op, vals, env):
    from jaxlib.mlir import ir

    pred = _PREDICATES_I[ir.IntegerAttr(op.attributes["predicate"]).value]
    a, b = vals
    if pred[0] == "u":
        a, b, pred = _unsigned(a), _unsigned(b), pred[1:]
    elif pred[0] == "s":
        pred = pred[1:]
    return [_CMP[pred](a, b)]


@rule("arith.cmpf")
def _cmpf(ex, op, vals, env):
    from jaxlib.mlir import ir

    pred = _PREDICATES_F[ir.IntegerAttr(op.attributes["predicate"]).value]
    a, b = (_f32(v) for v in vals)
    unordered = np.isnan(a) | np.isnan(b)
    if pred in ("false", "true"):
        return [np.full(np.broadcast(a, b).shape, pred == "true")]
    if pred in ("ord", "uno"):
        return [~unordered if pred == "ord" else unordered]
    base = _CMP[{"one": "ne", "une": "ne"}.get(pred, pred[1:])](a, b)
    return [base & ~unordered if pred[0] == "o" else base | unordered]


@rule("arith.select")
def _select(ex, op, vals, env):
    c, a, b = vals
    return [_cast(np.where(c, a, b), op)]


# -- casts -------------------------------------------------------------------


def _float_to_int(x, dtype):
    """Saturating, NaN to 0 (XLA's convert on TPU)."""
    x = _f32(x).astype(np.float64)
    info = np.iinfo(dtype)
    y = np.clip(np.trunc(np.nan_to_num(x, nan=0.0)), info.min, info.max)
    return y.astype(dtype)


@rule(
    "arith.extf",
    "arith.truncf",
    "arith.sitofp",
    "arith.extsi",
    "arith.trunci",
    "arith.index_cast",
    "tpu.extf",
    "tpu.sitofp",
    "tpu.truncf",
)
def _convert(ex, op, vals, env):
    return [_cast(vals[0], op)]


@rule("arith.extui", "arith.uitofp", "arith.index_castui")
def _convert_unsigned(ex, op, vals, env):
    x = np.asarray(vals[0])
    if x.dtype == np.bool_:
        return [_cast(x, op)]
    return [_cast(_unsigned(x), op)]


@rule("arith.fptosi", "tpu.fptosi")
def _fptosi(ex, op, vals, env):
    return [_float_to_int(vals[0], _out_dtype(op))]


@rule("arith.fptoui")
def _fptoui(ex, op, vals, env):
    d = _out_dtype(op)
    return [_float_to_int(vals[0], _UNSIGNED.get(d, d)).view(d)]


@rule("arith.bitcast")
def _bitcast(ex, op, vals, env):
    return [np.asarray(vals[0]).view(_out_dtype(op))]


@rule("tpu.assume_multiple", "tpu.assume_layout", "tpu.erase_memref_layout")
def _identity(ex, op, vals, env):
    return [vals[0]]


# -- attribute and operand helpers --------------------------------------------


def _array_attr(op, name) -> list[int]:
    """An integer attribute as a list, read through the MLIR bindings: a dense
    array (``array<i64: 1, 2>``, any width), an array of integers (``[1 : i32]``),
    dense integer elements, or one integer (``1 : i32`` gives ``[1]``); ``[]``
    when the op does not have it."""
    from jaxlib.mlir import ir

    if name not in op.attributes:
        return []
    a = op.attributes[name]  # the bindings give the attribute's own class
    dense = (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr, ir.DenseI16ArrayAttr, ir.DenseI8ArrayAttr)
    if isinstance(a, (*dense, ir.DenseIntElementsAttr)):
        return [int(x) for x in a]
    if isinstance(a, ir.ArrayAttr):
        return [int(ir.IntegerAttr(x).value) for x in a]
    if isinstance(a, ir.IntegerAttr):
        return [int(a.value)]
    raise MosaicError(f"run_mosaic: {where(op)}: attribute {name} = {a} is not an integer or integer array")


def bool_attr(op, name) -> bool:
    """A bool attribute (``add = true``); ``False`` when the op does not have it."""
    from jaxlib.mlir import ir

    return name in op.attributes and ir.BoolAttr(op.attributes[name]).value


def enum_attr(attr) -> str:
    """The case of a dialect's enum attribute: ``#tpu.memory_space<vmem>`` gives
    ``vmem``, ``#vector.kind<add>`` ``add``. jaxlib's bindings build these
    attributes but have no reader for them, so this is the one place (with
    ``tpu.matmul``'s dimension numbers) where run_mosaic reads an attribute's
    text."""
    s = str(attr)
    m = re.search(r"<(\w+)>$", s)
    return m.group(1) if m else s


def _operand(op, env, name):
    v = getattr(op, name)
    return None if v is None else env[v]


def _operands(op, env, name):
    return [env[v] for v in getattr(op, name)]
