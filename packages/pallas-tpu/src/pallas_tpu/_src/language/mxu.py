"""The MXU's own registers as JAX 0.12's ``pltpu`` exposes them:
``matmul_push_rhs``, ``matmul_acc_lhs``, ``matmul_pop``, ``matmul_lhs_fifo``,
``matmul_pop_fifo`` and the ``ACC`` memory space.

A TensorCore's MXUs (``get_tpu_info().num_mxus``, each ``mxu_column_size``
wide: K) hold a matrix of weights (the RHS, K x K) through which LHS rows
stream. A kernel drives one directly:

* ``matmul_push_rhs(rhs, staging_register, mxu_index)`` stages an RHS in one of
  the MXU's staging registers (a register holds one until it is loaded);
* ``matmul_acc_lhs(acc, lhs, load_staged_rhs=r)`` (chips with accumulators: TPU7x)
  first loads the staged RHS ``r`` into the weights (``None``: keep the weights
  loaded before), then adds ``lhs @ weights`` into ``acc``, a Ref in the MXU's
  accumulator memory (``pltpu.ACC(mxu_id)((M, K), jnp.float32)``, allocated by
  ``pl.run_scoped``); ``matmul_pop(acc)`` reads it and zeroes it;
* ``matmul_lhs_fifo(lhs, mxu_index, load_staged_rhs=r)`` (chips with a result FIFO)
  pushes ``lhs @ weights`` into the MXU's result FIFO; ``matmul_pop_fifo(shape,
  dtype, mxu_index)`` takes the oldest ``shape[0]`` rows out.

Products are exact sums of the operands' products, accumulated in float32 (float
operands) or int32 (integer operands). For sub-byte types (int4, fp4) the
contraction is 2K deep. A kernel must leave no staged RHS, no data in the FIFO and no
data in an accumulator when it ends (the hardware keeps them for the next kernel).
TPU interpret mode models these registers per core (``interpret/mxu.py``) and checks
every rule above; the lowering emits Mosaic's ops (``mosaic/lowering_mxu.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Effect, Primitive

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.language.vector_common import op_error


class MXUEffect(Effect):
    """Orders the MXU ops of a kernel (they act on registers no value names)."""

    def __str__(self) -> str:
        return "MXU"


mxu_effect = MXUEffect()
compat.allow_effect_in_kernels(MXUEffect)


@dataclasses.dataclass(frozen=True)
class AccMemorySpace:
    """The accumulator memory of MXU ``mxu_id`` (``pltpu.ACC``): ``ACC(0)((M, K),
    jnp.float32)`` is a Ref type of M rows of accumulators (M a multiple of the
    sublanes, K the MXU's width), for ``pl.run_scoped``."""

    mxu_id: int

    def __post_init__(self):
        if not isinstance(self.mxu_id, (int, np.integer)) or isinstance(self.mxu_id, bool):
            raise TypeError(f"pltpu.ACC: mxu_id must be an int, got {self.mxu_id!r}")
        compat_register(self)

    def __call__(self, shape: Sequence[int], dtype: Any) -> pl.MemoryRef:
        shape = tuple(int(d) for d in shape)
        check_accumulator_ref(shape, dtype, self.mxu_id)
        return pl.MemoryRef(shape, np.dtype(dtype), self)

    @property
    def whole_array(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"ACC(mxu_id={self.mxu_id})"


def compat_register(space) -> None:
    plb.register_neutral_memory_space(space)


plb.register_memory_space_type(AccMemorySpace)


def is_acc(aval) -> bool:
    return isinstance(getattr(aval, "memory_space", None), AccMemorySpace)


def check_accumulator_ref(shape: tuple[int, ...], dtype, mxu_id: int) -> None:
    """What an accumulator Ref may be on the target TPU (JAX's rules)."""
    info = tpu_info.get_tpu_info()
    if len(shape) < 2:
        raise ValueError(f"pltpu.ACC: an accumulator Ref is at least 2-D, got shape {shape}")
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.int32)):
        raise ValueError(f"pltpu.ACC: an accumulator holds float32 or int32, got {np.dtype(dtype)}")
    if not info.num_accumulators:
        raise ValueError(
            f"pltpu.ACC: accumulators are not available on TPU {info.chip_version} (its MXUs return "
            "results through a FIFO: use pltpu.matmul_lhs_fifo and pltpu.matmul_pop_fifo); TPU7x has them"
        )
    if not 0 <= mxu_id < info.num_mxus:
        raise ValueError(
            f"pltpu.ACC: mxu_id must be in [0, {info.num_mxus}) on TPU {info.chip_version}, got {mxu_id}"
        )
    m, n = math.prod(shape[:-1]), shape[-1]
    if n != info.mxu_column_size:
        raise ValueError(
            f"pltpu.ACC: the minor dimension of an accumulator Ref must be the MXU's width "
            f"{info.mxu_column_size}, got {n} (shape {shape})"
        )
    if m <= 0 or m % info.num_sublanes:
        raise ValueError(
            f"pltpu.ACC: the product of the major dimensions must be a positive multiple of "
            f"{info.num_sublanes} (the sublanes), got {m} (shape {shape})"
        )


# -- what each TPU generation's MXUs take (libtpu 0.0.48.1's Mosaic, compile-only devices) --

# Staging registers per MXU: Mosaic takes registers 0 and 1 on v5e, v5p, v6e and TPU7x,
# only 0 on v4.
_STAGING_REGISTERS = {"v4": 1, "v4i": 1, "v2": 1, "v3": 1}
# The operand types Mosaic's matmul_push_rhs takes, per generation (others: not refused here).
_RHS_TYPES = {
    "v4": ("float32", "bfloat16"),
    "v5e": ("float32", "bfloat16", "int8", "int4", "float8_e5m2"),
    "v5p": ("float32", "bfloat16", "int8", "int4", "float8_e5m2"),
    "v6e": ("float32", "bfloat16", "int8", "int4", "float8_e5m2"),
    "7x": ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
}


# RHS an MXU holds staged at once: on v4, v5e and v5p both staging registers are one
# store (Mosaic's scheduler: "Cannot schedule FIFO push instruction when the FIFO is full",
# kMsrA0), so a second push must wait for a matmul to load the first; v6e holds two.
_STAGED_AT_ONCE = {"v4": 1, "v4i": 1, "v2": 1, "v3": 1, "v5e": 1, "v5p": 1}


def num_staging_registers(info) -> int:
    return _STAGING_REGISTERS.get(str(info.chip_version), 2)


def staged_at_once(info) -> int:
    return _STAGED_AT_ONCE.get(str(info.chip_version), num_staging_registers(info))


def _check_chip_dtype(op: str, name: str, dtype) -> None:
    info = tpu_info.get_tpu_info()
    allowed = _RHS_TYPES.get(str(info.chip_version))
    if allowed is not None and np.dtype(dtype).name not in allowed:
        raise op_error(
            TypeError,
            op,
            f"the MXUs of TPU {info.chip_version} take {', '.join(allowed)} operands, got {name} of "
            f"{np.dtype(dtype).name}",
        )


def _has_fifo(op: str) -> None:
    info = tpu_info.get_tpu_info()
    if info.num_accumulators:
        raise op_error(
            ValueError,
            op,
            f"TPU {info.chip_version}'s MXUs have accumulators, not a result FIFO: use "
            "pltpu.matmul_acc_lhs into a pltpu.ACC Ref and pltpu.matmul_pop",
        )


# -- checks shared by the ops -----------------------------------------------------------


def _mxu_index(op: str, mxu_index) -> int:
    if not isinstance(mxu_index, (int, np.integer)) or isinstance(mxu_index, bool):
        raise op_error(TypeError, op, f"mxu_index must be a static int, got {mxu_index!r}")
    info = tpu_info.get_tpu_info()
    if not 0 <= mxu_index < info.num_mxus:
        raise op_error(
            ValueError,
            op,
            f"mxu_index must be in [0, {info.num_mxus}) on TPU {info.chip_version}, got {mxu_index}",
        )
    return int(mxu_index)


def _register(op: str, name: str, value, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        want = "an int or None" if optional else "an int"
        raise op_error(TypeError, op, f"{name} must be {want}, got {value!r}")
    if value < 0:
        raise op_error(ValueError, op, f"{name} must be >= 0, got {value}")
    return int(value)


def _staged_register(op: str, load_staged_rhs) -> int | None:
    """The staging register ``load_staged_rhs`` names (None: none), checked."""
    if isinstance(load_staged_rhs, bool):
        raise op_error(
            TypeError, op, "load_staged_rhs must be an integer or None (True would name register 1)"
        )
    return _register(op, "load_staged_rhs", load_staged_rhs, optional=True)


def is_sub_byte(dtype) -> bool:
    return jax.dtypes.itemsize_bits(np.dtype(dtype)) < 8


def _check_operand_dtype(op: str, name: str, dtype) -> None:
    dtype = np.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise op_error(TypeError, op, f"{name} must be a float or integer array, got {dtype}")
    if jax.dtypes.itemsize_bits(dtype) > 32:
        raise op_error(TypeError, op, f"{name} must be of at most 32 bits, got {dtype}")
    if jnp.issubdtype(dtype, jnp.integer) and jax.dtypes.itemsize_bits(dtype) > 8:
        raise op_error(TypeError, op, f"integer operands of the MXU are int8 or int4, got {name} of {dtype}")


def _check_lhs(op: str, lhs) -> None:
    info = tpu_info.get_tpu_info()
    _check_operand_dtype(op, "lhs", lhs.dtype)
    _check_chip_dtype(op, "lhs", lhs.dtype)
    k = info.mxu_column_size * (2 if is_sub_byte(lhs.dtype) else 1)
    if lhs.ndim != 2 or lhs.shape[1] != k:
        raise op_error(
            ValueError,
            op,
            f"lhs must be M x {k} (the MXU's width {info.mxu_column_size} on TPU {info.chip_version}"
            f"{', doubled for a sub-byte type' if k != info.mxu_column_size else ''}), got {lhs.dtype}{list(lhs.shape)}",
        )
    rows = info.num_sublanes * max(1, 32 // jax.dtypes.itemsize_bits(lhs.dtype))  # as Mosaic asks
    if lhs.shape[0] <= 0 or lhs.shape[0] % rows:
        raise op_error(
            ValueError,
            op,
            f"lhs rows M must be a positive multiple of {rows} (sublanes x packing of {lhs.dtype}), "
            f"got {lhs.shape[0]}",
        )


# -- matmul_push_rhs --------------------------------------------------------------------

matmul_push_rhs_p = Primitive("matmul_push_rhs")
matmul_push_rhs_p.multiple_results = True


def matmul_push_rhs(
    rhs: jax.Array, staging_register: int, mxu_index: int, *, transpose: bool = False
) -> None:
    """Stages ``rhs`` in a staging register of MXU ``mxu_index`` (JAX 0.12's API).

    A staging register holds one RHS until ``matmul_acc_lhs``/``matmul_lhs_fifo``
    load it (``load_staged_rhs``); pushing to a full register is an error, and so is
    a kernel that ends with one still full.

    Args:
      rhs: K x K (K: ``get_tpu_info().mxu_column_size``); for a sub-byte matmul
        (int4, fp4 LHS) 2K x K, or K x 2K with ``transpose``.
      staging_register: which staging register of the MXU.
      mxu_index: which MXU.
      transpose: stage ``rhs.T``.
    """
    op = "matmul_push_rhs"
    # Not optional: an int.
    reg = cast(int, _register(op, "staging_register", staging_register, optional=False))
    mxu = _mxu_index(op, mxu_index)
    if not isinstance(transpose, (bool, np.bool_)):
        raise op_error(TypeError, op, f"transpose must be True or False, got {transpose!r}")
    info = tpu_info.get_tpu_info()
    if reg >= num_staging_registers(info):
        raise op_error(
            ValueError,
            op,
            f"staging_register must be in [0, {num_staging_registers(info)}) on TPU {info.chip_version}, got {reg}",
        )
    rhs = jnp.asarray(rhs)
    _check_operand_dtype(op, "rhs", rhs.dtype)
    _check_chip_dtype(op, "rhs", rhs.dtype)
    k = info.mxu_column_size
    allowed = [(k, k), (k, 2 * k) if transpose else (2 * k, k)]
    if tuple(rhs.shape) not in allowed:
        raise op_error(
            ValueError,
            op,
            f"rhs must be {k} x {k} (the MXU's width), or {allowed[1][0]} x {allowed[1][1]} for a sub-byte "
            f"matmul, got {rhs.dtype}{list(rhs.shape)}",
        )
    matmul_push_rhs_p.bind(rhs, staging_register=reg, mxu_index=mxu, transpose=bool(transpose))


@matmul_push_rhs_p.def_effectful_abstract_eval
def _push_rhs_abstract_eval(rhs, **_):
    return [], {mxu_effect}


# -- matmul_acc_lhs / matmul_pop ------------------------------------------------------------

matmul_acc_lhs_p = Primitive("matmul_acc_lhs")
matmul_acc_lhs_p.multiple_results = True


def _acc_ref(op: str, acc):
    """The accumulator Ref under ``acc`` and whether ``acc`` is a view of it."""
    if isinstance(acc, compat.TransformedRef):
        ref, viewed = acc.ref, bool(acc.transforms)
    else:
        ref, viewed = acc, False
    aval = compat.typeof(ref) if hasattr(ref, "shape") else None
    if aval is None or not isinstance(aval, compat.AbstractRef) or not is_acc(aval):
        what = f"a Ref in {getattr(aval, 'memory_space', None)}" if aval is not None else repr(acc)
        raise op_error(
            TypeError,
            op,
            "acc must be a Ref in an MXU's accumulator memory (from pl.run_scoped(pltpu.ACC(mxu_id)"
            f"((M, K), jnp.float32))), got {what}",
        )
    if viewed:
        raise op_error(
            NotImplementedError, op, "acc must be a whole accumulator Ref (no .at[...] view), as in JAX"
        )
    return ref


def matmul_acc_lhs(acc: Any, lhs: jax.Array, load_staged_rhs: int | None = None) -> None:
    """Adds ``lhs @ weights`` into ``acc`` in the MXU of ``acc`` (JAX 0.12's API).

    Args:
      acc: a Ref of ``pltpu.ACC(mxu_id)``, M x K, float32 (float LHS) or int32 (integer LHS).
      lhs: M x K (M x 2K for a sub-byte type).
      load_staged_rhs: first load the RHS staged in this register into the weights;
        None: use the weights loaded before.
    """
    op = "matmul_acc_lhs"
    reg = _staged_register(op, load_staged_rhs)
    ref = _acc_ref(op, acc)
    lhs = jnp.asarray(lhs)
    _check_lhs(op, lhs)
    aval = compat.typeof(ref)
    if len(aval.shape) != 2 or aval.shape[0] != lhs.shape[0]:
        raise op_error(
            ValueError,
            op,
            f"acc must be M x K with the lhs's M rows: acc {list(aval.shape)}, lhs {list(lhs.shape)}",
        )
    want = np.int32 if jnp.issubdtype(lhs.dtype, jnp.integer) else np.float32
    if np.dtype(aval.dtype) != np.dtype(want):
        raise op_error(
            TypeError, op, f"a {lhs.dtype} lhs accumulates in {np.dtype(want)}, but acc holds {aval.dtype}"
        )
    matmul_acc_lhs_p.bind(ref, lhs, load_staged_rhs=reg)


@matmul_acc_lhs_p.def_effectful_abstract_eval
def _acc_lhs_abstract_eval(acc, lhs, **_):
    return [], {mxu_effect, compat.ReadEffect(0), compat.WriteEffect(0)}


matmul_pop_p = Primitive("matmul_pop")


def matmul_pop(acc: Any) -> jax.Array:
    """The value of accumulator ``acc``, which it then zeroes (JAX 0.12's API)."""
    return matmul_pop_p.bind(_acc_ref("matmul_pop", acc))


@matmul_pop_p.def_effectful_abstract_eval
def _pop_abstract_eval(acc):
    return jax.core.ShapedArray(acc.shape, acc.dtype), {
        mxu_effect,
        compat.ReadEffect(0),
        compat.WriteEffect(0),
    }


# -- matmul_lhs_fifo / matmul_pop_fifo --------------------------------------------------------

matmul_lhs_fifo_p = Primitive("matmul_lhs_fifo")
matmul_lhs_fifo_p.multiple_results = True


def matmul_lhs_fifo(lhs: jax.Array, mxu_index: int, *, load_staged_rhs: int | None = None) -> None:
    """Pushes ``lhs @ weights`` of MXU ``mxu_index`` into its result FIFO (JAX 0.12's API).

    Args:
      lhs: M x K (M x 2K for a sub-byte type); M a multiple of the sublanes
        times the dtype's packing.
      mxu_index: which MXU.
      load_staged_rhs: first load the RHS staged in this register; None: use the
        weights loaded before.
    """
    op = "matmul_lhs_fifo"
    reg = _staged_register(op, load_staged_rhs)
    mxu = _mxu_index(op, mxu_index)
    _has_fifo(op)
    lhs = jnp.asarray(lhs)
    _check_lhs(op, lhs)
    matmul_lhs_fifo_p.bind(lhs, mxu_index=mxu, load_staged_rhs=reg)


@matmul_lhs_fifo_p.def_effectful_abstract_eval
def _lhs_fifo_abstract_eval(lhs, **_):
    return [], {mxu_effect}


matmul_pop_fifo_p = Primitive("matmul_pop_fifo")


def matmul_pop_fifo(shape: tuple[int, int], dtype: Any, mxu_index: int) -> jax.Array:
    """The oldest ``shape[0]`` rows of MXU ``mxu_index``'s result FIFO (JAX 0.12's API).

    Args:
      shape: (M, K), K the MXU's width.
      dtype: float32 (float operands) or int32 (integer operands).
      mxu_index: which MXU.
    """
    op = "matmul_pop_fifo"
    mxu = _mxu_index(op, mxu_index)
    _has_fifo(op)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.int32)):
        raise op_error(ValueError, op, f"the result FIFO holds float32 or int32 results, got {dtype}")
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        raise op_error(TypeError, op, f"shape must be a tuple of two ints, got {shape!r}") from None
    info = tpu_info.get_tpu_info()
    if len(dims) != 2 or dims[1] != info.mxu_column_size or dims[0] <= 0 or dims[0] % info.num_sublanes:
        raise op_error(
            ValueError,
            op,
            f"shape must be (M, {info.mxu_column_size}) with M a positive multiple of {info.num_sublanes}, "
            f"got {dims}",
        )
    return matmul_pop_fifo_p.bind(shape=dims, dtype=dtype, mxu_index=mxu)


@matmul_pop_fifo_p.def_effectful_abstract_eval
def _pop_fifo_abstract_eval(*, shape, dtype, mxu_index):
    return jax.core.ShapedArray(shape, dtype), {mxu_effect}


MXU_PRIMITIVES = (matmul_push_rhs_p, matmul_acc_lhs_p, matmul_pop_p, matmul_lhs_fifo_p, matmul_pop_fifo_p)

ACC = AccMemorySpace
__all__ = [
    "ACC",
    "AccMemorySpace",
    "matmul_acc_lhs",
    "matmul_lhs_fifo",
    "matmul_pop",
    "matmul_pop_fifo",
    "matmul_push_rhs",
]
