"""Helpers for TPU kernels (JAX's ``pltpu.sync_copy``, ``core_barrier``,
``run_on_first_core``), written with the kernel language's own primitives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import primitives as tpu_prims


def sync_copy(src_ref: Any, dst_ref: Any, *, add: bool = False) -> None:
    """Copies ``src_ref`` to ``dst_ref`` (Refs, views, or matching pytrees of
    them) with DMAs, and waits for them: all copies are started, then all
    waited for, on one scoped DMA semaphore.

    Args:
      src_ref, dst_ref: same shapes and dtypes, leaf by leaf.
      add: add into ``dst_ref`` instead of overwriting it.
    """
    is_leaf = lambda x: not isinstance(x, (tuple, list, dict))  # noqa: E731
    srcs, src_tree = jax.tree.flatten(src_ref, is_leaf=is_leaf)
    dsts, dst_tree = jax.tree.flatten(dst_ref, is_leaf=is_leaf)
    if src_tree != dst_tree:  # type: ignore[operator]  # jax.tree.flatten's PyTreeDef is unresolved in JAX's stubs
        raise plb.kernel_error(
            ValueError,
            f"pltpu.sync_copy: src_ref and dst_ref have different structures ({src_tree} vs {dst_tree})",
        )
    srcs = [s for s in srcs if s is not None]
    dsts = [d for d in dsts if d is not None]
    if not srcs:
        return

    def body(sem):
        copies = [tpu_prims.make_async_copy(s, d, sem) for s, d in zip(srcs, dsts)]
        for c in copies:
            c.start(add=add)
        for c in copies:
            c.wait()

    pl.run_scoped(body, tpu_core.SemaphoreType.DMA(()))


def run_on_first_core(core_axis_name: str) -> Callable[[Callable[[], Any]], None]:
    """Decorator: runs the function only on core 0 of the named core axis
    (on every call when the axis has one core)."""
    num_cores = lax.axis_size(core_axis_name)
    if num_cores == 1:
        return lambda f: f()

    def wrapped(f):
        @pl.when(lax.axis_index(core_axis_name) == 0)
        @functools.wraps(f)
        def _():
            f()

    return wrapped


def core_barrier(sem: Any, *, core_axis_name: str) -> None:
    """Waits until every core of ``core_axis_name`` reaches this point: each
    signals ``sem`` (a REGULAR semaphore) on all the others, then waits for
    their signals."""
    num_cores = lax.axis_size(core_axis_name)
    if num_cores == 1:
        return
    core_id = lax.axis_index(core_axis_name)
    for i in range(num_cores):

        @pl.when(core_id != i)
        def _(i=i):
            pl.semaphore_signal(sem, 1, core_index=i)

    pl.semaphore_wait(sem, num_cores - 1)
