"""Binding ``triton_call`` arguments to kernel parameters.

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

from jax_triton._src.triton_compat import JITFunction

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


def scalar_type(value) -> str:
    """Triton type of a Python/numpy scalar argument (as Triton's JIT does)."""
    if isinstance(value, (bool, np.bool_)):
        return "u1"
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if -(2**31) <= v < 2**31:
            return "i32"
        if 2**63 <= v < 2**64:
            return "u64"
        return "i64"
    if isinstance(value, np.floating):
        return {2: "fp16", 4: "fp32", 8: "fp64"}[value.dtype.itemsize]
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"not a scalar: {value!r}")


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
        return {p.name: p.value for p in self.params if p.kind == "constexpr"}

    def attrs(self) -> dict[tuple[int], list]:
        return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(self.params) if p.divisible_by_16}

    def key(self):
        """Hashable identity of the specialization (for compile caches)."""
        return tuple((p.name, p.type, p.operand, _hashable(p.value), p.divisible_by_16) for p in self.params)


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


def bind(
    fn: JITFunction,
    args: tuple,
    out_avals: list,
    metaparams: dict[str, Any],
) -> BoundCall:
    """Binds inputs, then outputs, positionally; then metaparams by name.

    ``args`` holds avals (anything with .shape/.dtype) for arrays and plain
    Python scalars for scalars.
    """
    names = list(fn.arg_names)
    kernel = fn.__name__
    unknown = [m for m in metaparams if m not in names]
    if unknown:
        raise TypeError(
            f"metaparam(s) {unknown} of triton_call are not parameters of kernel "
            f"{kernel!r}; its parameters are {names}"
        )
    positional = list(args) + list(out_avals)
    n_pos = len(positional)
    if n_pos > len(names) or any(m in names[:n_pos] for m in metaparams):
        raise TypeError(
            f"kernel {kernel!r} has {len(names)} parameters {names}, but "
            f"triton_call binds {len(args)} inputs + {len(out_avals)} outputs "
            f"positionally and metaparams {sorted(metaparams)} by name"
        )
    missing = [n for n in names[n_pos:] if n not in metaparams and not _has_default(fn, n)]
    if missing:
        raise TypeError(
            f"kernel {kernel!r} has {len(names)} parameters {names}; triton_call "
            f"bound {len(args)} inputs + {len(out_avals)} outputs positionally, "
            f"leaving {missing} without a value: pass them as arguments or "
            f"metaparams"
        )
    params = []
    next_operand = 0  # arrays are operands; scalars are not
    for i, (name, kp) in enumerate(zip(names, fn.params)):
        if i < n_pos:
            value, operand = positional[i], -1
            if is_array(value):
                operand, next_operand = next_operand, next_operand + 1
        else:
            value = metaparams[name] if name in metaparams else _default(fn, name)
            operand = -1
        params.append(_bind_one(kernel, name, kp, value, operand, i < len(args)))
    return BoundCall(kernel, tuple(params))


def _bind_one(kernel, name, kp, value, operand, is_input) -> ParamBinding:
    where = f"{'input' if is_input else 'output'} {name!r} of kernel {kernel!r}"
    if kp.is_constexpr:
        if is_array(value):
            raise TypeError(f"constexpr parameter {name!r} of {kernel!r} got an array")
        return ParamBinding(name, "constexpr", "constexpr", value=value)
    if operand >= 0 and is_array(value):
        ty = "*" + triton_dtype(value.dtype, where)
        return ParamBinding(name, "buffer", ty, operand=operand, divisible_by_16=True)
    if is_array(value):
        raise TypeError(f"parameter {name!r} of {kernel!r} got an array as a metaparam")
    if not isinstance(value, (bool, int, float, np.generic)):
        raise TypeError(
            f"parameter {name!r} of kernel {kernel!r} got {value!r} of type "
            f"{type(value).__name__}; triton_call takes arrays and Python/numpy "
            f"scalars"
        )
    ty = scalar_type(value)
    if isinstance(value, np.generic):
        value = value.item()
    specialize = not kp.do_not_specialize
    if ty in ("i32", "i64", "u64") and specialize and value == 1:
        return ParamBinding(name, "constexpr", "constexpr", value=1)
    div16 = ty in ("i32", "i64", "u64") and specialize and value % 16 == 0
    if kp.do_not_specialize_on_alignment:
        div16 = False
    return ParamBinding(name, "scalar", ty, value=value, divisible_by_16=div16)


def _has_default(fn, name) -> bool:
    return fn.signature.parameters[name].default is not inspect.Parameter.empty


def _default(fn, name):
    return fn.signature.parameters[name].default
