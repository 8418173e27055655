"""Binding ``triton_call``'s operands to kernel parameters.

The result, a ``BoundCall``, is what both backends consume: the GPU path turns
it into a Triton signature + specialization and a runtime parameter layout;
the CPU path turns it into interpreter arguments. Specialization follows
Triton's own JIT (ints equal to 1 become constexprs, pointers and ints
divisible by 16 get ``tt.divisibility=16``), so a kernel compiles to the same
code as when launched from torch.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_triton._src.triton_compat import JITFunction, constexpr_tuple

# JAX dtype -> Triton element type name.
_DTYPES = {
    np.dtype(np.bool_): "i1",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint8): "u8",
    np.dtype(np.uint16): "u16",
    np.dtype(np.uint32): "u32",
    np.dtype(np.uint64): "u64",
    np.dtype(np.float16): "fp16",
    np.dtype(np.float32): "fp32",
    np.dtype(np.float64): "fp64",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float8_e4m3fn): "fp8e4nv",
    np.dtype(jnp.float8_e5m2): "fp8e5",
}


def triton_dtype(dtype, what: str) -> str:
    """Triton element type for a JAX dtype, or a TypeError naming ``what``."""
    try:
        return _DTYPES[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(sorted(str(d) for d in _DTYPES))
        raise TypeError(
            f"{what} has dtype {dtype}, which Triton kernels cannot take; supported dtypes: {supported}"
        ) from None


def scalar_type(value, what: str = "scalar") -> str:
    """Triton type of a Python/numpy scalar argument (as Triton's JIT does).

    Integers must fit int64 or uint64 (Triton's widest scalar parameters);
    anything else is a ValueError naming ``what``.
    """
    if isinstance(value, (bool, np.bool_)):
        return "u1"
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if -(2**31) <= v < 2**31:
            return "i32"
        if 2**63 <= v < 2**64:
            return "u64"
        if -(2**63) <= v < 2**63:
            return "i64"
        raise ValueError(
            f"{what} is {v}, which does not fit in int64 (or uint64), the widest "
            f"integer a Triton kernel parameter can take"
        )
    if isinstance(value, np.floating):
        if value.dtype.itemsize not in (2, 4, 8):
            raise TypeError(f"{what} is a {value.dtype} scalar; Triton takes float16/32/64")
        return {2: "fp16", 4: "fp32", 8: "fp64"}[value.dtype.itemsize]
    if isinstance(value, float):
        if abs(value) > _FP32_MAX and abs(value) != float("inf"):
            raise ValueError(
                f"{what} is {value!r}, which overflows float32, the type Triton gives "
                f"Python floats; pass np.float64({value!r}) for a float64 parameter"
            )
        return "fp32"
    raise TypeError(f"{what} is not a scalar: {value!r}")


_FP32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class ParamBinding:
    """What one kernel parameter is bound to.

    kind: "buffer" (operand index into inputs ++ outputs), "scalar" or
    "constexpr" (value baked into the compiled kernel).
    """

    name: str
    kind: str
    type: str  # Triton signature type: "*fp32", "i32", "constexpr"
    operand: int = -1
    value: Any = None
    divisible_by_16: bool = False


@dataclasses.dataclass(frozen=True)
class BoundCall:
    kernel_name: str
    params: tuple[ParamBinding, ...]

    def signature(self) -> dict[str, str]:
        return {p.name: p.type for p in self.params}

    def constexprs(self) -> dict[str, Any]:
        """The constexpr values, as Triton's code generator takes them."""
        return {p.name: _constexpr_value(p.value) for p in self.params if p.kind == "constexpr"}

    def attrs(self) -> dict[tuple[int], list]:
        return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(self.params) if p.divisible_by_16}

    def key(self):
        """Hashable identity of the specialization (for compile caches)."""
        return tuple((p.name, p.type, p.operand, _hashable(p.value), p.divisible_by_16) for p in self.params)


def _constexpr_value(v):
    """A tuple becomes a ``tl.tuple`` of constexprs (``triton_compat.constexpr_tuple``)."""
    return constexpr_tuple(v) if isinstance(v, tuple) else v


def _hashable(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not np.isscalar(x)
    )


@dataclasses.dataclass(frozen=True)
class Operand:
    """What ``triton_call`` gave one kernel parameter (``operands.resolve``).

    kind: "input" (``index`` among the array inputs), "output" (``index``
    among the outputs) or "value" (a Python/numpy scalar or None, ``value``).
    ``what`` names it in errors: "argument 0 ('x_ptr')", "output 1 ('y_ptr')".
    """

    what: str
    kind: str
    index: int = -1
    value: Any = None


def bind(
    fn: JITFunction,
    operands: dict[str, Operand],
    in_avals,
    out_avals,
    metaparams: dict[str, Any],
    where: str | None = None,
) -> BoundCall:
    """Binds the operands, then metaparams by name, then declared defaults.

    Array operands become buffers numbered inputs first, then outputs, as the
    primitive's operands are. ``where`` (``triton_call 'k' at file.py:12``)
    starts every error message.
    """
    names = list(fn.arg_names)
    kernel = fn.__name__
    where = where or f"triton_call {kernel!r}"
    unknown = [m for m in metaparams if m not in names]
    if unknown:
        raise TypeError(
            f"{where}: metaparam(s) {unknown} of triton_call are not parameters of "
            f"kernel {kernel!r}; its parameters are {names}"
        )
    twice = [m for m in metaparams if m in operands]
    if twice:
        raise TypeError(
            f"{where}: kernel {kernel!r} has {len(names)} parameters {names}; {twice} "
            f"got an argument and a metaparam (of an autotune config or heuristic)"
        )
    missing = [n for n in names if n not in operands and n not in metaparams and not has_default(fn, n)]
    if missing:
        raise TypeError(
            f"{where}: kernel {kernel!r} has {len(names)} parameters {names}; "
            f"triton_call bound {sorted(operands)} and metaparams {sorted(metaparams)}, "
            f"leaving {missing} without a value: pass them as arguments or metaparams"
        )
    params = []
    for name, kp in zip(names, fn.params):
        operand = -1
        if name in operands:
            op = operands[name]
            what, value = op.what, op.value
            if op.kind == "input":
                value, operand = in_avals[op.index], op.index
            elif op.kind == "output":
                value, operand = out_avals[op.index], len(in_avals) + op.index
        else:
            what = f"metaparam {name!r}"
            value = metaparams[name] if name in metaparams else fn.signature.parameters[name].default
        params.append(_bind_one(f"{where}: {what}", name, kp, value, operand))
    return BoundCall(kernel, tuple(params))


def _describe(value) -> str:
    if is_array(value):
        return f"an array {np.dtype(value.dtype).name}{list(value.shape)}"
    return f"{value!r:.60} of type {type(value).__name__}"


def _bind_one(what, name, kp, value, operand) -> ParamBinding:
    if kp.is_constexpr or value is None:  # Triton's JIT makes a None argument a constexpr
        if is_array(value):
            raise TypeError(
                f"{what} is a tl.constexpr parameter but got {_describe(value)}; "
                f"constexprs take Python values known when tracing"
            )
        return ParamBinding(name, "constexpr", "constexpr", value=value)
    annotation = kp.annotation_type  # "i32", "*fp32" or "" when not annotated
    if operand >= 0 and is_array(value):
        if annotation and not annotation.startswith("*"):
            raise TypeError(
                f"{what} is annotated {annotation} (a scalar) but got "
                f"{_describe(value)}; pass a Python/numpy scalar (an array, even "
                f"0-d, is passed as a pointer; a traced value cannot be a scalar "
                f"parameter: tl.load it in the kernel instead)"
            )
        ty = "*" + triton_dtype(value.dtype, what)
        return ParamBinding(name, "buffer", ty, operand=operand, divisible_by_16=True)
    if is_array(value):
        raise TypeError(f"{what} got {_describe(value)}; metaparams take Python values, not arrays")
    if not isinstance(value, (bool, int, float, np.generic)):
        raise TypeError(f"{what} got {_describe(value)}; triton_call takes arrays and Python/numpy scalars")
    if annotation.startswith("*"):
        raise TypeError(
            f"{what} is annotated {annotation} (a pointer) but got the scalar "
            f"{_describe(value)}; pass an array"
        )
    ty = scalar_type(value, what)
    if isinstance(value, np.generic):
        value = value.item()
    if annotation and annotation != ty:  # Triton's JIT takes the annotated type
        ty, value = annotation, _convert(value, annotation, what)
    specialize = not kp.do_not_specialize
    if ty in ("i32", "i64", "u64") and specialize and value == 1:
        return ParamBinding(name, "constexpr", "constexpr", value=1)
    div16 = ty in ("i32", "i64", "u64") and specialize and value % 16 == 0
    if kp.do_not_specialize_on_alignment:
        div16 = False
    return ParamBinding(name, "scalar", ty, value=value, divisible_by_16=div16)


_INT_TYPES = {f"{k}{b}": np.iinfo(f"{k}nt{b}") for k in ("i", "ui") for b in (8, 16, 32, 64)}
_INT_TYPES = {k.replace("ui", "u"): v for k, v in _INT_TYPES.items()}


def _convert(value, ty: str, what: str):
    """``value`` as a parameter of annotated Triton type ``ty``, checked to fit."""
    if ty in ("i1", "u1"):
        if value not in (0, 1):
            raise ValueError(f"{what} is annotated {ty} (a bool) but got {value!r}")
        return bool(value)
    if ty in _INT_TYPES:
        info = _INT_TYPES[ty]
        if isinstance(value, float) or not info.min <= value <= info.max:
            raise ValueError(
                f"{what} is annotated {ty} but got {value!r}, which is not an "
                f"integer in [{info.min}, {info.max}]"
            )
        return int(value)
    if ty in ("fp16", "bf16", "fp32", "fp64"):
        return float(value)
    raise TypeError(f"{what} is annotated {ty}, which triton_call cannot pass as a scalar")


def has_default(fn, name) -> bool:
    return fn.signature.parameters[name].default is not inspect.Parameter.empty
