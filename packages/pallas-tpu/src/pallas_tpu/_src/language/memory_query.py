"""``pltpu.has_memory_space`` (JAX 0.12): asks, in the kernel, where a
``pl.ANY`` Ref was placed.

A ``pl.ANY`` operand is put where the compiler chooses; the kernel's trace
only knows "any". ``has_memory_space(ref, pltpu.HBM)`` is a bool scalar that
the compiler resolves once it has placed the operand, so a kernel can take a
DMA path for an array left in HBM and a direct path for one placed in VMEM
(``pl.when`` / ``lax.cond`` on it).

Where it is answered:

* TPU interpret mode: the memory the Ref's buffer is in; ``pl.ANY``
  operands live in the model's HBM (pallas-core's ``interpret=True`` says the same).
* Mosaic: ``tpu.memref_memory_space_is``, which the compiler folds to a
  constant. jaxlib's Mosaic dialect has the op from JAX 0.12; on an older JAX
  the lowering refuses the kernel, naming the JAX release to install.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

import pallas as pl
from pallas_tpu._src import compat
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language.vector_common import op_error

has_memory_space_p = Primitive("has_memory_space")

_SPACES = (
    tpu_core.VMEM,
    tpu_core.SMEM,
    tpu_core.HBM,
    tpu_core.VMEM_SHARED,
    tpu_core.CMEM,
    tpu_core.SEMAPHORE,
)


def has_memory_space(ref: Any, memory_space: Any) -> jax.Array:
    """Whether the ``pl.ANY`` Ref ``ref`` was placed in ``memory_space``.

    Unlike ``ref.memory_space`` (what the trace knows: ``pl.ANY``), this is
    answered by the compiler once it has placed the operand. Branch on it with
    ``pl.when`` or ``jax.lax.cond``.

    Args:
      ref: a Ref in ``pl.ANY`` memory space, or a view of one (``ref.at[...]``).
      memory_space: a concrete TPU memory space (``pltpu.HBM``, ``pltpu.VMEM``...).

    Returns:
      A bool scalar.
    """
    op = "has_memory_space"
    base = ref.ref if isinstance(ref, compat.TransformedRef) else ref
    aval = compat.typeof(base)
    if not isinstance(aval, compat.AbstractRef):
        raise op_error(TypeError, op, f"ref must be a Ref in pl.ANY memory space, got {type(ref).__name__}")
    # A pl.ANY operand's Ref carries no memory space in our avals (pallas-core keeps its own spaces
    # out of them), as a default-space block's does not: only a concrete space is known wrong here.
    if aval.memory_space not in (None, pl.ANY):
        raise op_error(ValueError, op, f"ref must have pl.ANY memory space, but got {aval.memory_space}")
    if memory_space is pl.ANY:
        raise op_error(
            ValueError,
            op,
            "has_memory_space(..., pl.ANY) is not supported: give a concrete memory space "
            "(pltpu.HBM, pltpu.VMEM, pltpu.SMEM...)",
        )
    if memory_space not in _SPACES:
        raise op_error(
            TypeError,
            op,
            f"memory_space must be a pltpu memory space (pltpu.HBM, pltpu.VMEM...), got {memory_space!r}",
        )
    return has_memory_space_p.bind(base, memory_space=memory_space)


@has_memory_space_p.def_abstract_eval
def _abstract_eval(ref_aval, *, memory_space):
    del ref_aval, memory_space
    return compat.shaped_array((), jnp.bool_)


def placed_in(memory_space) -> bool:
    """pallas-core's interpret mode's answer: its ``pl.ANY`` operands live in HBM."""
    return memory_space is tpu_core.HBM


def _discharge(ctx, ref, *, memory_space):
    del ctx, ref  # the Ref is not changed
    return [None], jnp.bool_(placed_in(memory_space))


compat.register_discharge_rule(has_memory_space_p)(_discharge)
