"""``pl.get_global`` (JAX 0.12): a Ref that outlives one run of the kernel
body, the same buffer at every grid step (a semaphore that the kernels of a
collective signal across steps).

JAX lowers it only for Mosaic GPU kernels (global-memory semaphores); its TPU
lowering and its interpret modes refuse it. No backend here has such memory
(pallas-gpu's Triton kernels, pallas-tpu's Mosaic kernels and both interpret
modes), so ours refuses it where the kernel calls it, naming what to use
instead: a Ref that a kernel call allocates (``scratch_shapes=``,
``pl.run_scoped``) lives across its grid steps already.
"""

from __future__ import annotations

from typing import Any

from pallas._src.errors import kernel_error


def get_global(what: Any) -> Any:
    """A Ref that persists across invocations of the kernel body (JAX: Mosaic GPU only).

    Args:
      what: the Ref's type, as a scratch shape (a backend's ``SemaphoreType``
        member, ``pltpu.SemaphoreType.REGULAR((2,))``...).

    Raises:
      NotImplementedError: always; no backend here keeps memory across kernel invocations.
    """
    if not hasattr(what, "get_ref_aval"):
        raise kernel_error(
            TypeError, f"pl.get_global: what must be a Ref type such as a SemaphoreType member, got {what!r}"
        )
    raise kernel_error(
        NotImplementedError,
        f"pl.get_global({what}) is not supported: JAX lowers it only for Mosaic GPU kernels "
        "(global-memory semaphores), and no backend here (Mosaic TPU, Triton, the interpret modes) keeps "
        "memory across kernel invocations; allocate the Ref with scratch_shapes= or pl.run_scoped, which "
        "lives across the grid steps of one kernel call",
    )
