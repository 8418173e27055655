"""What the value-level TPU primitive modules share (``vector_primitives.py``,
``vector_packing.py``, ``vector_annotations.py``).

Conventions (one block per primitive, in this order): ``foo_p``, the public
``foo()`` that validates its arguments at trace time, the abstract eval, then
the batching (and, where the op is differentiable, AD) rules, then the
*interpret semantics*: a plain-``jnp`` function registered as the primitive's
MLIR lowering for every platform (``mlir.lower_fun``, ``register_interpret``).
In TPU interpret mode the kernel body becomes plain JAX, so this is what the op
computes there; the Mosaic lowering registers its own rule for platform ``tpu``.

Bad arguments raise at trace time through ``pallas.backend.kernel_error``
(``op_error``), so an error raised inside a kernel names the kernel and the
user's line (this folder is registered as internal: its frames are skipped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pallas.backend import kernel_error, register_internal_dir

register_internal_dir(__file__)


def op_error(cls: type[Exception], op: str, msg: str) -> Exception:
    return kernel_error(cls, f"pltpu.{op}: {msg}")


def bit_width(dtype) -> int:
    return jax.dtypes.itemsize_bits(jnp.dtype(dtype))


def uint_dtype(bits: int):
    return {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[bits]


def register_interpret(prim: Primitive, impl, multiple_results: bool = False) -> None:
    """``impl`` (plain jnp) is the op's meaning off the TPU: eagerly and in jit."""
    prim.def_impl(impl)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))


def move_to_front(x, bdim):
    return x if bdim == 0 else jnp.moveaxis(x, bdim, 0)
