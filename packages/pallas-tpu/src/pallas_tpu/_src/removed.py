"""Names JAX's Pallas TPU API removed or moved, for ``pallas_tpu``'s module
``__getattr__`` (``pallas.backend.module_getattr``): JAX's words and where the name went
(a name with a target still works, with a ``DeprecationWarning``)."""

from __future__ import annotations

#: ``pallas_tpu`` (JAX's ``pltpu`` module, 0.11), and ``repeat``, removed before 0.11.
PALLAS_TPU: dict[str, tuple[str, str | None]] = {
    "HOST": (
        "pltpu.HOST was deprecated in JAX v0.10.0, and removed in JAX v0.12.0. Use pl.HOST instead.",
        None,
    ),
    **{
        name: (
            f"pltpu.{name} was deprecated in JAX v0.10.0, and removed in JAX v0.11.0. Use pl.{name} instead.",
            None,
        )
        for name in ("semaphore", "DeviceIdType", "semaphore_read", "semaphore_signal", "semaphore_wait")
    },
    "repeat": (
        "pltpu.repeat was removed from JAX's Pallas TPU API before JAX v0.11.0: use jnp.tile (or "
        "jnp.concatenate of copies) on the loaded value instead.",
        None,
    ),
    # Removed in JAX 0.12.1 (deprecated since 0.11), kept here with JAX's deprecation warning:
    # JAX 0.10.2, the oldest JAX we support, has no TensorCoreMesh, so code written for it has
    # only this name (docs/differences.md).
    "create_tensorcore_mesh": (
        "pltpu.create_tensorcore_mesh is deprecated, use pltpu.TensorCoreMesh instead.",
        "pallas_tpu._src.language.core:create_tensorcore_mesh",
    ),
}
