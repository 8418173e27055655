"""The patches ``_interpret`` applies to Triton's interpreter while a kernel
runs (see that module): bounds checks of every memory access, bf16 and fp8 on
values, compiler hints checked on values, and the arguments as the interpreter takes
them, in one place: a Triton release that changes the interpreter breaks this
file only. ``_batched`` wraps the builder operations patched here."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from jax_kernel_runtime.triton import _state
from jax_kernel_runtime.triton._state import interpreter

_COMPARISONS = (np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal)


def pointer_arg(signature_type: str, address: int):
    import triton.language as tl

    interp = interpreter()
    ty = tl.str_to_ty(signature_type, None)
    return tl.tensor(interp.TensorHandle(np.array([address], dtype=np.uint64), ty), ty)


def scalar_arg(value):
    """A scalar kernel argument as the interpreter passes it. A Python bool is
    an ``int1`` holding a NumPy bool (Triton 3.6's ``_implicit_cvt`` stores it
    as int32 data, which its ``TensorHandle`` then rejects)."""
    import triton.language as tl

    interp = interpreter()
    if isinstance(value, (bool, np.bool_)):
        return tl.tensor(interp.TensorHandle(np.array([bool(value)], np.bool_), tl.int1), tl.int1)
    return interp._implicit_cvt(value)


def _elem_bytes(ptrs) -> int:
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


def _mask_of(mask) -> np.ndarray | None:
    return None if mask is None else mask.data


@functools.cache
def _originals() -> dict[str, Any]:
    b = interpreter().InterpreterBuilder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
             "create_dot", "binary_op", "cast_impl", "create_fp_to_fp")  # fmt: skip
    return {n: getattr(b, n) for n in names}


# *policy: (cache_modifier, eviction_policy, is_volatile) in Triton 3.6, (cache_policy,
# is_volatile) in 3.9 (loads), without is_volatile for stores: passed through as given,
# positionally or by keyword (the interpreter's tensor-descriptor loads pass keywords).
def _masked_load(self, ptrs, mask, other, *policy, **policy_kw):
    _state.check_access("load", ptrs.data, _mask_of(mask), _elem_bytes(ptrs))
    return _originals()["create_masked_load"](self, ptrs, mask, other, *policy, **policy_kw)


def _masked_store(self, ptrs, value, mask, *policy, **policy_kw):
    _state.check_access("store", ptrs.data, _mask_of(mask), _elem_bytes(ptrs))
    return _originals()["create_masked_store"](self, ptrs, value, mask, *policy, **policy_kw)


def _atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
    _state.check_access("atomic", ptr.data, _mask_of(mask), _elem_bytes(ptr))
    return _originals()["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)


def _atomic_cas(self, ptr, cmp, val, sem, scope):
    _state.check_access("atomic_cas", ptr.data, None, _elem_bytes(ptr))
    return _originals()["create_atomic_cas"](self, ptr, cmp, val, sem, scope)


# ---------------------------------------------------------------------------
# bf16 on values, rounded as on the GPU


def _bf16_to_fp32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)  # exact


def _fp32_to_bf16(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return np.where(np.isnan(data), 0x7FC0, rounded).astype(np.uint16)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``create_dot`` that widens bf16 and fp8 operands to fp32 (exact) first:
    Triton 3.6 multiplies the raw ``uint16`` bits of a bf16 as integers."""
    import triton.language as tl

    interp = interpreter()
    fp8 = _fp8_types()
    ops = []
    for t in (a, b):
        if t.dtype.scalar == tl.bfloat16:
            t = interp.TensorHandle(_bf16_to_fp32(t.data), tl.float32)
        elif t.dtype.scalar in fp8:  # exact; Triton 3.6 decodes fp8 by hand (wrong NaNs)
            t = interp.TensorHandle(t.data.view(fp8[t.dtype.scalar]).astype(np.float32), tl.float32)
        ops.append(t)
    return _originals()["create_dot"](self, ops[0], ops[1], d, input_precision, max_num_imprecise_acc)


def _binary_op(self, lhs, rhs, op):
    """bf16 arithmetic in fp32, rounded back to bf16 (Triton 3.6 applies
    numpy ops to the ``uint16`` storage)."""
    import triton.language as tl

    original = _originals()["binary_op"]
    if lhs.dtype.scalar != tl.bfloat16:
        return original(self, lhs, rhs, op)
    interp = interpreter()
    out = original(
        self,
        interp.TensorHandle(_bf16_to_fp32(lhs.data), tl.float32),
        interp.TensorHandle(_bf16_to_fp32(rhs.data), tl.float32),
        op,
    )
    if op in _COMPARISONS:
        return out
    return interp.TensorHandle(_fp32_to_bf16(out.data), tl.bfloat16)


def _cast(self, src, dst_type):
    """Casts to and from bf16 go through fp32, as on the GPU: bf16 -> fp32 is
    exact and fp32 -> bf16 rounds to nearest even. Triton's interpreter casts
    the raw ``uint16`` bits of a bf16 with NumPy (an int, bool or fp64 to bf16
    came out as tiny subnormals), decodes bf16 subnormals wrongly, and 3.6
    truncates fp32 -> bf16."""
    import triton.language as tl

    original = _originals()["cast_impl"]
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if (src_ty == tl.bfloat16) == (dst_ty == tl.bfloat16):  # neither, or bf16 -> bf16
        return original(self, src, dst_type)
    interp = interpreter()
    if src_ty == tl.bfloat16:
        wide = interp.TensorHandle(_bf16_to_fp32(src.data), tl.float32)
        return wide if dst_ty == tl.float32 else original(self, wide, dst_type)
    if src_ty != tl.float32:
        src = original(self, src, tl.float32)
    return interp.TensorHandle(_fp32_to_bf16(src.data), tl.bfloat16)


def _get_bf16(self, value):
    """A bf16 constant (``bf16_block + 0.1``): Triton 3.6's interpreter has no
    ``get_bf16``. Its bf16 data are uint16 bit patterns, rounded to nearest even."""
    import triton.language as tl

    return interpreter().TensorHandle(_fp32_to_bf16(np.array([value], np.float32)), tl.bfloat16)


# ---------------------------------------------------------------------------
# fp8 on values, converted as on the GPU


@functools.cache
def _fp8_types() -> dict[Any, Any]:
    """Triton's NVIDIA fp8 types and their NumPy types (``ml_dtypes``, which
    JAX depends on). Triton's interpreter stores fp8 as ``uint8`` bits."""
    import ml_dtypes
    import triton.language as tl

    return {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}


def _values(data: np.ndarray, ty) -> np.ndarray:
    """The values of an interpreter tensor's float data, as float32 (float64
    as itself)."""
    import triton.language as tl

    if ty == tl.bfloat16:
        return _bf16_to_fp32(data)
    if ty in _fp8_types():
        return data.view(_fp8_types()[ty]).astype(np.float32)
    return data if data.dtype.itemsize == 8 else data.astype(np.float32)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    """Conversions to and from the NVIDIA fp8 types as the GPU does them
    (``cvt.rn.satfinite``): to fp8 rounded to nearest even, and saturated to
    the largest finite value (infinities too; NaN stays NaN); from fp8 exact.
    Triton 3.6's interpreter rounds by hand without carrying into the exponent
    (0.49 -> 0.25 in e4m3) and saturates nothing. (Triton refuses casts
    between ints and fp8.)"""
    import triton.language as tl

    interp = interpreter()
    fp8 = _fp8_types()
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if src_ty not in fp8 and dst_ty not in fp8:
        return _originals()["create_fp_to_fp"](self, src, dst_type, rounding_mode)
    x = _values(src.data, src_ty)
    if dst_ty in fp8:
        big = float(np.finfo(fp8[dst_ty]).max)
        with np.errstate(invalid="ignore"):
            x = np.where(np.isnan(x), x, np.clip(x, -big, big))
        return interp.TensorHandle(x.astype(fp8[dst_ty]).view(np.uint8), dst_ty)
    if dst_ty == tl.bfloat16:
        return interp.TensorHandle(_fp32_to_bf16(x), tl.bfloat16)
    return interp.TensorHandle(x.astype(_np_dtype(dst_ty)), dst_ty)


def _np_dtype(ty) -> np.dtype:
    return np.dtype(f"float{ty.primitive_bitwidth}")  # fp8 converts to floats only


_BUILDER_PATCHES = {
    "create_fp_to_fp": _fp_to_fp,
    "get_bf16": _get_bf16,
    "create_masked_load": _masked_load,
    "create_masked_store": _masked_store,
    "create_atomic_rmw": _atomic_rmw,
    "create_atomic_cas": _atomic_cas,
    "create_dot": _dot,
    "binary_op": _binary_op,
    "cast_impl": _cast,
}


# ---------------------------------------------------------------------------
# Compiler hints


def hint_patches(scope) -> None:
    """``tl.multiple_of`` and ``tl.max_contiguous`` check their hint on the
    values (``_state.check_hint``); Triton's interpreter ignores it."""
    import triton.language as tl

    for name, kind in (("multiple_of", "tt.divisibility"), ("max_contiguous", "tt.contiguity")):
        scope.set_attr(tl, name, functools.partial(_checked_hint, getattr(tl, name), kind))


def _checked_hint(original, kind, input, values, *args, **kwargs):
    import triton.language as tl

    if isinstance(input, tl.tensor):
        hint = values if isinstance(values, (list, tuple)) else [values]
        hint = [v.value if isinstance(v, tl.constexpr) else v for v in hint]
        _state.check_hint(kind, input.handle.data, hint, [int(d) for d in input.shape])
    return original(input, values, *args, **kwargs)


def builder_patches(scope) -> None:
    """Patches the interpreter's builder: bounds-checked memory operations and
    bf16 on values."""
    _originals()
    for name, patched in _BUILDER_PATCHES.items():
        scope.set_attr(interpreter().InterpreterBuilder, name, patched)
