"""``pl.enable_poison_buffers`` (JAX 0.12): scratch buffers that a kernel
allocates with ``pl.run_scoped`` start out holding poison, so that a read
before the first write shows up.

Poison is NaN for floating-point buffers, the most negative value for signed
and unsigned integers (the bit pattern ``100...0``), and True for bool
buffers, as JAX's Mosaic lowering writes it. Backends ask
``poison_buffers_enabled()`` when they allocate: the TPU interpreter fills
the buffer, the Mosaic lowering stores the poison after the allocation.
JAX's own switch, ``jax.config.update("jax_pallas_poison_buffers", True)``
(JAX 0.12), turns it on too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas._src import compat

# JAX config states (None: off), so that a switch is part of the jit cache key and the trace
# context: a function traced with the switch off is traced again with it on, as JAX's own
# switches are.
_poison = compat.config_state("pallas_ours_poison_buffers", "pl.enable_poison_buffers' switch.")


class GlobalSwitch:
    """A process-wide setting held in a config ``state``: set to ``enabled`` from now on, or
    inside a ``with`` block, after which the value it had comes back."""

    def __init__(self, state, enabled: bool):
        self.state = state
        self.previous = state.value
        state.set_global(bool(enabled))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.state.set_global(self.previous)


class enable_poison_buffers(GlobalSwitch):  # noqa: N801  (JAX's name; a function and a context manager)
    """Turns buffer poisoning on (or off) from now on, or inside a ``with``
    block: ``with pl.enable_poison_buffers(): ...``.

    Args:
      enabled: whether ``pl.run_scoped`` buffers start out poisoned.
    """

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"pl.enable_poison_buffers: enabled must be a bool, got {enabled!r}")
        super().__init__(_poison, enabled)


def poison_buffers_enabled() -> bool:
    """Whether scratch buffers are poisoned (ours, or JAX 0.12's config switch)."""
    return bool(_poison.value) or bool(getattr(jax.config, "jax_pallas_poison_buffers", False))


def poison_value(dtype) -> np.ndarray:
    """The poison scalar of ``dtype`` (see the module docstring)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.array(True)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(np.nan, dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    return (
        np.array(1 << (bits - 1), np.uint64)
        .astype(np.dtype(f"uint{max(bits, 8)}"))
        .view(np.dtype(f"int{max(bits, 8)}"))
        .astype(dtype)
    )
