"""DMAs in TPU interpret mode: the rules of ``dma_start_p`` and ``dma_wait_p``.

What a TPU does, and so what is modelled: ``start`` issues a copy from the
start descriptor's source to its destination; as the data lands, the DMA adds
its byte count to the destination semaphore. ``wait`` blocks until that
semaphore holds the wait descriptor's byte count and takes it off: the wait's
source and destination name no memory, only a size. Kernels rely on it: they
wait with a rebuilt descriptor, or a "dummy" one of the same size (another
slot of the buffer, another buffer, a local descriptor for a remote copy).

* ``dma_execution_mode="eager"``: the copy happens at ``start``.
* ``"on_wait"`` (the default): a copy into on-chip memory (VMEM, SMEM) reads
  its source at ``start`` into a shadow of its destination, each element
  marked with the semaphore whose wait lands it. A wait lands what is marked
  with its semaphore in its own descriptor's region, and, when that is fewer
  bytes than it waits for, in every buffer that a DMA on the semaphore went to.
  So a kernel that reads a destination before waiting sees the old contents.
  A copy into HBM lands at ``start``: a kernel reads HBM only through DMAs, and
  a DMA that reads what another still writes is a race on a TPU too.
* Semaphores count bytes, as on a TPU: a wait for more than its semaphore can
  ever hold is reported as a deadlock (a TPU hangs), and bytes left on a
  semaphore when the kernel ends as a DMA that was not waited for.
* Shadows and marks are flat cells, and a DMA between two contiguous runs of
  its cells (``buf.at[slot]``, ``x.at[pl.ds(i, n)]``; ``flat_region``) copies,
  shadows and lands a 1-d run: XLA compiles one kernel for buffers of one size
  whatever their shapes (its CPU compile time goes mostly by distinct kernels).
* A DMA whose size is traced (``src.at[pl.ds(i, n)]`` with ``n`` read from
  SMEM) moves the flat elements of its views (``RefAccess.view_indices``):
  static upper-bound shapes, the elements past ``n`` masked out.

``DmaEngine`` runs them: it owns what on_wait DMAs leave in flight (which
semaphores' DMAs went to which buffers), reads and writes the DMAs' ends through
``dma_views.DmaViews``, and talks to a transport (``transport.LocalTransport`` for
one device, ``multi.DeviceTransport`` for several or for race detection): remote
DMAs (``device_id=``) go through its ``remote_dma_start``, ``remote_dma_wait``
(the send side) and ``dma_receive``, race detection through ``on_dma_start`` and
``on_dma_wait``, semaphores that it shares through ``semaphores.Semaphores``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src.interpret import rules as interpret_rules
from pallas_tpu._src.interpret.dma_views import DmaView, DmaViews
from pallas_tpu._src.interpret.errors import Checks, count_true
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import RefAccess, RefView, is_slice, is_static_int
from pallas_tpu._src.interpret.semaphores import Semaphores
from pallas_tpu._src.language import primitives as tpu_prims


class DmaEngine:
    """Starts and waits of a kernel's DMAs (see the module docstring) over
    ``memory``'s cells, their ends made, read and written by ``views``, their
    bounds through ``refs`` and ``checks``; byte counts on ``semaphores``; what
    leaves the device through ``transport``. ``on_wait``: ``dma_execution_mode``
    is ``"on_wait"`` (copies into shadowed buffers land at their wait)."""

    def __init__(
        self,
        views: DmaViews,
        memory: Memory,
        refs: RefAccess,
        checks: Checks,
        semaphores: Semaphores,
        transport,
        *,
        on_wait: bool,
    ):
        self.views = views
        self.memory = memory
        self.refs = refs
        self.checks = checks
        self.semaphores = semaphores
        self.transport = transport
        self.on_wait = on_wait
        self.sites: list[tuple[int, int]] = []  # (semaphore cell, destination cell) of started DMAs

    # -- the rules ------------------------------------------------------------

    def start(self, eqn, ops) -> list:
        layout, v = _dma_parts(eqn, ops)
        if layout.device_id_tree is not None:
            self.transport.remote_dma_start(eqn, v, layout)
            return []
        src, dst = self.views.endpoints(eqn, v["src"], v["dst"])
        add = bool(eqn.params.get("add", False))
        if self.on_wait and self._shadowed(dst.cell):
            self._start_pending(eqn, src, dst, v["dst_sem"], add)
        else:
            self._copy(eqn, src, dst, add)
        self.semaphores.add(v["dst_sem"], src.nbytes, eqn)
        self.transport.on_dma_start(eqn, v)
        return []

    def wait(self, eqn, ops) -> list:
        layout, v = _dma_parts(eqn, ops)
        which = eqn.params["which"]
        if which == "send":
            self.transport.remote_dma_wait(eqn, v, layout, which)
            return []
        nbytes = self.views.dma_nbytes(v["src"], eqn)
        self.transport.dma_receive(
            eqn, v["dst_sem"], v["dst"], nbytes, remote=layout.device_id_tree is not None
        )
        self.semaphores.wait(v["dst_sem"], nbytes, eqn, what="DMA semaphore")
        if self.on_wait and v["dst_sem"].cell in self.memory.shadows:
            self._commit_pending(eqn, v["dst_sem"], v["dst"], nbytes)
        if which == "dst":
            self.transport.on_dma_wait(eqn, v)
        return []

    # -- copies ---------------------------------------------------------------

    def _shadowed(self, cell: int) -> bool:
        """An on-chip data buffer that on_wait DMAs land in through a shadow."""
        return len(self.memory.shadows.get(cell, ())) == 2

    def _read_src(self, eqn, src: DmaView):
        """A DMA's source data, and whether it is a flat run (``flat_region``)."""
        region = self.views.flat_region(src, eqn, "DMA read")
        if region is None:
            return self.views.read(src, eqn, "DMA read"), False
        return self.views.read(src, eqn, "DMA read", region=region), True

    def _dst_run(self, eqn, src: DmaView, dst: DmaView):
        """A DMA's source data and its destination's ``flat_region``: the data a 1-d run
        when both ends are one, else in the source view's shape. (A block of rows narrower
        than its array is not flattened: XLA would then compute each element's row and
        column by a division in the copy's loop, 1.7x slower in steady state.)"""
        val, flat = self._read_src(eqn, src)
        region = self.views.flat_region(dst, eqn, "DMA write") if flat else None
        if region is not None:
            return val, region
        return (lax.reshape(val, src.shape) if flat else val), None

    def _copy(self, eqn, src: DmaView, dst: DmaView, add: bool) -> None:
        val, region = self._dst_run(eqn, src, dst)
        if add:
            val = self.views.read(dst, eqn, "write", region=region) + val
        self.views.write(dst, val, eqn, region=region)

    # -- on_wait: DMAs in flight ----------------------------------------------

    def _sem_code(self, view, eqn):
        """A number naming one semaphore (its cell and element), >= 1."""
        base = self.memory.sem_code_bases.get(view.cell, np.int32(view.cell * 65536 + 1))
        return lax.add(self.refs.flat_index(view, eqn), base)

    def _start_pending(self, eqn, src: DmaView, dst: DmaView, sem, add: bool) -> None:
        """on_wait: the data goes to the destination's shadow, marked with the
        semaphore whose wait lands it (whatever descriptor that wait is given)."""
        shadow, pending = self.memory.shadows[dst.cell]
        val, region = self._dst_run(eqn, src, dst)
        if region is None and dst.idx is None:
            self.refs.read_view(dst.view, eqn, what="DMA write")  # bounds of the destination
        if add or not self._whole_slot(dst):
            self._land_earlier(eqn, dst, shadow, pending, region)
        self.views.write(dst, val, eqn, cell=shadow, region=region)
        mark = self._sem_code(sem, eqn) * 2 + int(add)
        self.views.write(dst, jnp.full(jnp.shape(val), mark, jnp.int32), eqn, cell=pending, region=region)
        site = (sem.cell, dst.cell)
        if site not in self.sites:
            self.sites.append(site)

    def _whole_slot(self, dv: DmaView) -> bool:
        """``dv`` is the whole buffer or a whole slot of it (integer indices on leading
        axes, the rest whole: ``buf.at[slot]``): two such views of a buffer are the same
        elements or none of the same."""
        if dv.idx is not None:
            return False
        ts = dv.view.transforms
        if not ts:
            return True
        x = self.memory.state[dv.cell]
        if len(ts) != 1 or not hasattr(ts[0], "indices") or len(ts[0].indices) != x.ndim:
            return False
        whole = False
        for ix, n in zip(ts[0].indices, x.shape):
            if is_slice(ix):
                if not (is_static_int(ix.size) and int(ix.size) == n):
                    return False
                whole = True
            elif jnp.ndim(ix) != 0 or whole:
                return False
        return True

    def _land_earlier(self, eqn, dst: DmaView, shadow: int, pending: int, region) -> None:
        """What earlier DMAs left pending in ``dst`` lands before a DMA start replaces its
        shadow: a TPU lands a DMA's data at any time before its wait. Two DMAs in flight
        into overlapping regions of a ring buffer (tokamax's routing gmm fetches its row
        indices so) otherwise lost the earlier one's data where they overlap (its wait
        landed nothing there and the kernel read the old contents), and of two adding
        DMAs one addition. (A DMA into a whole slot that another DMA still fills is a
        race on a TPU unless it adds: ``_whole_slot`` starts skip this.)"""
        with self.checks.unchecked():  # the destination was checked by the caller
            new, _, _ = self._land_view(eqn, dst, shadow, pending, region, None)
            self.views.write(dst, new, eqn, region=region)

    def _land_view(self, eqn, dv: DmaView, shadow: int, pending: int, region, code):
        """``_land`` over the elements of ``dv`` (its shadow, marks and data)."""
        return _land(
            self.views.read(dv, eqn, "read", cell=shadow, region=region),
            self.views.read(dv, eqn, "read", cell=pending, region=region),
            self.views.read(dv, eqn, "read", region=region),
            code,
            self.views.valid(dv),
        )

    def _commit_pending(self, eqn, sem, dst_view: RefView, nbytes) -> None:
        """on_wait: a wait on a DMA semaphore lands the DMAs started on it.

        The region the wait's descriptor names is landed first (cheap, and all a
        wait with the start's own descriptor needs). Only when that landed fewer
        bytes than the wait takes (the descriptor was rebuilt for another slot or
        buffer) are the buffers that DMAs on the semaphore went to landed whole, in a
        ``lax.cond``: every element still marked with the semaphore. (Marks are never
        more than the bytes started on the semaphore and not landed, so that is
        landing what is pending; no byte counters are kept.)"""
        cells = sorted(
            {d for s, d in self.sites if s == sem.cell and self._shadowed(d)}
            | ({dst_view.cell} if self._shadowed(dst_view.cell) else set())
        )
        if not cells:  # no DMA on this semaphore went through a shadow: nothing to land
            return
        code = self._sem_code(sem, eqn)
        landed: jnp.ndarray | np.int32 = np.int32(0)
        if self._shadowed(dst_view.cell):
            # On a TPU the wait's descriptor names no memory: nothing to bound-check.
            with self.checks.unchecked():
                dv = self.views.dma_view(dst_view, eqn, "DMA wait")
                shadow, pending = self.memory.shadows[dv.cell]
                region = self.views.flat_region(dv, eqn, "read")
                new, mark, n = self._land_view(eqn, dv, shadow, pending, region, code)
                self.views.write(dv, new, eqn, region=region)
                self.views.write(dv, mark, eqn, cell=pending, region=region)
            landed = lax.mul(n, np.int32(np.dtype(self.memory.state[dv.cell].dtype).itemsize))

        def land_all(vals, shadows):
            return [_land(sh, mark, cur, code)[:2] for (cur, mark), sh in zip(vals, shadows)]

        # Flat, as the companions are (see Memory.new_cell): buffers of one size then share
        # the kernels of the landing.
        vals = [(_flat(self.memory.state[c]), self.memory.state[self.memory.shadows[c][1]]) for c in cells]
        shadows = [self.memory.state[self.memory.shadows[c][0]] for c in cells]
        short = lax.lt(landed, jnp.asarray(nbytes, jnp.int32))
        vals = lax.cond(short, land_all, lambda vals, shadows: [tuple(v) for v in vals], vals, shadows)
        for c, (new, mark) in zip(cells, vals):
            self.memory.state[c] = lax.reshape(new, self.memory.state[c].shape)
            self.memory.state[self.memory.shadows[c][1]] = mark


def _dma_parts(eqn, ops):
    layout = eqn.params["layout"]
    parts = layout.split(ops)
    views = {}
    for name, tree in (
        ("src", layout.src_tree),
        ("dst", layout.dst_tree),
        ("dst_sem", layout.dst_sem_tree),
        ("src_sem", layout.src_sem_tree),
    ):
        if name in parts:
            ref, leaves = parts[name]
            views[name] = ref.with_transforms(plb.unflatten_transforms(tree, leaves))
    views["device_id"] = parts["device_id"]
    return layout, views


def _land(shadow_val, mark, cur, code, valid=None):
    """(new value, new marks, elements landed) of the DMAs marked ``code`` (of every
    pending DMA with ``code=None``)."""
    # lax, not jnp: every wait traces this, and each jnp call is a jitted function to trace.
    if code is None:
        mine = lax.ne(mark, np.int32(0))
    else:
        mine = lax.eq(lax.shift_right_arithmetic(mark, np.int32(1)), jnp.asarray(code, mark.dtype))
    if valid is not None:
        mine = jnp.logical_and(mine, valid)
    added = lax.bitwise_or(cur, shadow_val) if cur.dtype == np.bool_ else lax.add(cur, shadow_val)
    landed = lax.select(lax.eq(lax.bitwise_and(mark, np.int32(1)), np.int32(1)), added, shadow_val)
    count = count_true(mine)
    return lax.select(mine, landed, cur), lax.select(mine, lax.full_like(mark, 0), mark), count


def _flat(x):
    return lax.reshape(x, (x.size,))


def _dma_start(interp, eqn, *ops):
    return interp.dma.start(eqn, ops)


def _dma_wait(interp, eqn, *ops):
    return interp.dma.wait(eqn, ops)


interpret_rules.STATE_RULES[tpu_prims.dma_start_p] = _dma_start
interpret_rules.STATE_RULES[tpu_prims.dma_wait_p] = _dma_wait
