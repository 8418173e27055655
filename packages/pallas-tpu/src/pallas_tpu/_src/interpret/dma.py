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
  SMEM) moves the flat elements of its views (``Interpreter.view_indices``):
  static upper-bound shapes, the elements past ``n`` masked out.

Remote DMAs (``device_id=``) go through the hooks ``remote_dma_start``,
``remote_dma_wait`` (the send side) and ``dma_receive``, which the
multi-device interpreter (``multi.py``) implements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import rules as interpret_rules
from pallas_tpu._src.interpret.errors import count_true
from pallas_tpu._src.interpret.refs import RefView, clip_index, has_traced_sizes, is_slice, is_static_int
from pallas_tpu._src.language import primitives as tpu_prims


@dataclasses.dataclass(frozen=True)
class DmaView:
    """One end of a DMA: a view of a cell, its dtype and shape (ints, or traced
    sizes), and for a view whose size is traced its flat element indices
    (``Interpreter.view_indices``; None for a static view)."""

    view: RefView
    dtype: Any
    shape: tuple
    idx: Any = None

    @property
    def cell(self) -> int:
        return self.view.cell

    def on(self, cell: int) -> DmaView:
        """The same region of a companion cell of the same shape (shadow, marks)."""
        return dataclasses.replace(self, view=RefView(cell, self.view.transforms))

    @property
    def nbytes(self):
        """The byte count: an int, or a traced int32 when the size is traced."""
        return _as_count(math.prod(self.shape) * np.dtype(self.dtype).itemsize)


def _as_count(n):
    return n if isinstance(n, (int, np.integer)) else jnp.asarray(n, jnp.int32)


def dma_view(interp, view: RefView, eqn, what: str) -> DmaView:
    x = interp.state[view.cell]
    if not any(has_traced_sizes(t) for t in view.transforms):
        aval = plb.transformed_aval(compat.shaped_array(x.shape, x.dtype), view.transforms)
        return DmaView(view, aval.dtype, tuple(aval.shape))
    idx, shape = interp.view_indices(view, eqn, what)
    return DmaView(view, x.dtype, shape, idx)


def dma_nbytes(interp, view: RefView, eqn):
    """The byte count of a descriptor's view: what a wait on it takes off its semaphore."""
    x = interp.state[view.cell]
    aval = plb.transformed_aval(compat.shaped_array(x.shape, x.dtype), view.transforms)
    return _as_count(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def endpoints(interp, eqn, src_view: RefView, dst_view: RefView) -> tuple[DmaView, DmaView]:
    """The two ends of a DMA. When a size is traced, both as flat indices of
    one static shape (position i of one is position i of the other)."""
    src = dma_view(interp, src_view, eqn, "DMA read")
    dst = dma_view(interp, dst_view, eqn, "DMA write")
    if src.idx is None and dst.idx is None:
        return src, dst
    if src.idx is None:
        src = dataclasses.replace(src, idx=interp.view_indices(src_view, eqn, "DMA read")[0])
    if dst.idx is None:
        dst = dataclasses.replace(dst, idx=interp.view_indices(dst_view, eqn, "DMA write")[0])
    common = tuple(slice(0, min(a, b)) for a, b in zip(src.idx.shape, dst.idx.shape))
    src = dataclasses.replace(src, idx=src.idx[common])
    dst = dataclasses.replace(dst, idx=dst.idx[common])
    for d, (a, b) in enumerate(zip(src.shape, dst.shape)):
        if not (isinstance(a, int) and isinstance(b, int)):
            interp.check(
                jnp.asarray(a) == jnp.asarray(b),
                f"{interp.where(eqn)}: the DMA's source has {{0}} elements along dimension {d} "
                "and its destination {1}; they must be equal",
                [a, b],
            )
    return src, dst


def flat_region(interp, dv: DmaView, eqn, what: str):
    """(flat offset, element count) of the elements of ``dv``'s cell that a static
    view covers, when they are one contiguous run (row-major: a view such as
    ``buf.at[slot]`` or ``x.at[pl.ds(i, 128)]``); None otherwise. The offset's
    indices are bounds-checked and clamped as a read of the view is.

    DMAs move such regions as 1-d runs of the flattened cells (a bitcast to XLA):
    the kernels XLA compiles for them then depend on the run's length only, so
    buffers of one size and different shapes share them (XLA's CPU compile time
    goes mostly by distinct kernels)."""
    if dv.idx is not None:
        return None
    x = interp.state[dv.cell]
    ts = dv.view.transforms
    if not ts:
        return (0, x.size) if x.size else None
    if len(ts) != 1 or not hasattr(ts[0], "indices") or len(ts[0].indices) != x.ndim:
        return None
    sizes = []
    for ix in ts[0].indices:
        if is_slice(ix):
            if not (is_static_int(ix.size) and is_static_int(ix.stride) and int(ix.stride) == 1):
                return None
            sizes.append(int(ix.size))
        elif jnp.ndim(ix) == 0:
            sizes.append(1)
        else:
            return None
    if not all(sizes):
        return None
    partial = [d for d, (k, n) in enumerate(zip(sizes, x.shape)) if k < n]
    if partial and any(k > 1 for k in sizes[: partial[-1]]):
        return None  # rows of a block narrower than the buffer: not one run
    starts = interp.refs.index_parts(x.shape, ts[0], eqn, dv.view, what)[0]
    fixed, terms, step = 0, [], 1
    for d in reversed(range(x.ndim)):
        if sizes[d] < x.shape[d]:
            st = clip_index(starts[d], 0, x.shape[d] - sizes[d])
            if is_static_int(st):
                fixed += int(st) * step
            else:
                terms.append(lax.mul(st, np.int32(step)) if step != 1 else st)
        step *= x.shape[d]
    if not terms:
        return fixed, math.prod(sizes)
    offset = terms[0]
    for t in terms[1:]:
        offset = lax.add(offset, t)
    return (lax.add(offset, np.int32(fixed)) if fixed else offset), math.prod(sizes)


def _flat(x):
    return lax.reshape(x, (x.size,))


def _run(flat, region):
    offset, n = region
    if is_static_int(offset):
        return flat if (offset, n) == (0, flat.size) else lax.slice(flat, (offset,), (offset + n,))
    return lax.dynamic_slice(flat, (offset,), (n,), allow_negative_indices=False)  # clamped


def _put_run(flat, region, val):
    offset, n = region
    val = lax.reshape(jnp.asarray(val, flat.dtype), (n,))
    if is_static_int(offset) and (offset, n) == (0, flat.size):
        return val
    return lax.dynamic_update_slice(
        flat, val, (jnp.asarray(offset, jnp.int32),), allow_negative_indices=False
    )


def read(interp, dv: DmaView, eqn, what: str, cell: int | None = None, region=None):
    """The view's elements in ``cell``: by default its own data cell, else a flat
    companion of it (``interp.shadows``). With ``region`` (``flat_region``'s
    answer), as a 1-d run."""
    x = interp.state[dv.cell if cell is None else cell]
    if region is not None:
        return _run(lax.reshape(x, (x.size,)), region)
    with _shaped(interp, dv, cell):
        dv = dv if cell is None else dv.on(cell)
        if dv.idx is None:
            return interp.read_view(dv.view, eqn, what=what)
        x = interp.state[dv.cell]
        return x.reshape(-1)[jnp.clip(dv.idx, 0, max(x.size - 1, 0))]


def write(interp, dv: DmaView, val, eqn, cell: int | None = None, region=None) -> None:
    """Writes ``val`` (the view's shape, or a 1-d run with ``region``) as ``read`` reads."""
    if region is not None:
        c = dv.cell if cell is None else cell
        x = interp.state[c]
        interp.state[c] = lax.reshape(_put_run(lax.reshape(x, (x.size,)), region, val), x.shape)
        return
    with _shaped(interp, dv, cell):
        dv = dv if cell is None else dv.on(cell)
        if dv.idx is None:
            interp.write_view(dv.view, val, eqn)
            return
        x = interp.state[dv.cell]
        val = jnp.asarray(val, x.dtype).reshape(-1)
        interp.state[dv.cell] = x.reshape(-1).at[dv.idx.reshape(-1)].set(val, mode="drop").reshape(x.shape)


@contextlib.contextmanager
def _shaped(interp, dv: DmaView, cell: int | None):
    """A flat companion cell of ``dv``'s data cell seen in the data cell's shape
    meanwhile, for views that are not one run (strided, bitcast, traced sizes)."""
    if cell is None or cell == dv.cell:
        yield
        return
    flat = interp.state[cell].shape
    interp.state[cell] = lax.reshape(interp.state[cell], interp.state[dv.cell].shape)
    try:
        yield
    finally:
        interp.state[cell] = lax.reshape(interp.state[cell], flat)


def _valid(interp, dv: DmaView):
    return None if dv.idx is None else dv.idx < interp.state[dv.cell].size


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


def _shadowed(interp, cell: int) -> bool:
    """An on-chip data buffer that on_wait DMAs land in through a shadow."""
    return len(interp.shadows.get(cell, ())) == 2


def _read_src(interp, eqn, src: DmaView):
    """A DMA's source data, and whether it is a flat run (``flat_region``)."""
    region = flat_region(interp, src, eqn, "DMA read")
    if region is None:
        return read(interp, src, eqn, "DMA read"), False
    return read(interp, src, eqn, "DMA read", region=region), True


def _dst_run(interp, eqn, src: DmaView, dst: DmaView):
    """A DMA's source data and its destination's ``flat_region``: the data a 1-d run
    when both ends are one, else in the source view's shape. (A block of rows narrower
    than its array is not flattened: XLA would then compute each element's row and
    column by a division in the copy's loop, 1.7x slower in steady state.)"""
    val, flat = _read_src(interp, eqn, src)
    region = flat_region(interp, dst, eqn, "DMA write") if flat else None
    if region is not None:
        return val, region
    return (lax.reshape(val, src.shape) if flat else val), None


def _copy(interp, eqn, src: DmaView, dst: DmaView, add: bool) -> None:
    val, region = _dst_run(interp, eqn, src, dst)
    if add:
        val = read(interp, dst, eqn, "write", region=region) + val
    write(interp, dst, val, eqn, region=region)


def _dma_start(interp, eqn, *ops):
    layout, v = _dma_parts(eqn, ops)
    if layout.device_id_tree is not None:
        interp.remote_dma_start(eqn, v, layout)
        return []
    src, dst = endpoints(interp, eqn, v["src"], v["dst"])
    add = bool(eqn.params.get("add", False))
    if interp.params.dma_execution_mode == "on_wait" and _shadowed(interp, dst.cell):
        _start_pending(interp, eqn, src, dst, v["dst_sem"], add)
    else:
        _copy(interp, eqn, src, dst, add)
    interp.sem_add(v["dst_sem"], src.nbytes, eqn)
    interp.on_dma_start(eqn, v)
    return []


def _sem_code(interp, view, eqn):
    """A number naming one semaphore (its cell and element), >= 1."""
    base = interp.sem_code_bases.get(view.cell, np.int32(view.cell * 65536 + 1))
    return lax.add(interp.flat_index(view, eqn), base)


def _start_pending(interp, eqn, src: DmaView, dst: DmaView, sem, add: bool) -> None:
    """on_wait: the data goes to the destination's shadow, marked with the
    semaphore whose wait lands it (whatever descriptor that wait is given)."""
    shadow, pending = interp.shadows[dst.cell]
    val, region = _dst_run(interp, eqn, src, dst)
    if region is None and dst.idx is None:
        interp.read_view(dst.view, eqn, what="DMA write")  # bounds of the destination
    if add or not _whole_slot(interp, dst):
        _land_earlier(interp, eqn, dst, shadow, pending, region)
    write(interp, dst, val, eqn, cell=shadow, region=region)
    mark = _sem_code(interp, sem, eqn) * 2 + int(add)
    write(interp, dst, jnp.full(jnp.shape(val), mark, jnp.int32), eqn, cell=pending, region=region)
    site = (sem.cell, dst.cell)
    if site not in interp.dma_sites:
        interp.dma_sites.append(site)


def _whole_slot(interp, dv: DmaView) -> bool:
    """``dv`` is the whole buffer or a whole slot of it (integer indices on leading
    axes, the rest whole: ``buf.at[slot]``): two such views of a buffer are the same
    elements or none of the same."""
    if dv.idx is not None:
        return False
    ts = dv.view.transforms
    if not ts:
        return True
    x = interp.state[dv.cell]
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


def _land_earlier(interp, eqn, dst: DmaView, shadow: int, pending: int, region) -> None:
    """What earlier DMAs left pending in ``dst`` lands before a DMA start replaces its
    shadow: a TPU lands a DMA's data at any time before its wait. Two DMAs in flight
    into overlapping regions of a ring buffer (tokamax's routing gmm fetches its row
    indices so) otherwise lost the earlier one's data where they overlap (its wait
    landed nothing there and the kernel read the old contents), and of two adding
    DMAs one addition. (A DMA into a whole slot that another DMA still fills is a
    race on a TPU unless it adds: ``_whole_slot`` starts skip this.)"""
    with interp.unchecked():  # the destination was checked by the caller
        new, _, _ = _land_view(interp, eqn, dst, shadow, pending, region, None)
        write(interp, dst, new, eqn, region=region)


def _land_view(interp, eqn, dv: DmaView, shadow: int, pending: int, region, code):
    """``_land`` over the elements of ``dv`` (its shadow, marks and data)."""
    return _land(
        read(interp, dv, eqn, "read", cell=shadow, region=region),
        read(interp, dv, eqn, "read", cell=pending, region=region),
        read(interp, dv, eqn, "read", region=region),
        code,
        _valid(interp, dv),
    )


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


def _commit_pending(interp, eqn, sem, dst_view: RefView, nbytes) -> None:
    """on_wait: a wait on a DMA semaphore lands the DMAs started on it.

    The region the wait's descriptor names is landed first (cheap, and all a
    wait with the start's own descriptor needs). Only when that landed fewer
    bytes than the wait takes (the descriptor was rebuilt for another slot or
    buffer) are the buffers that DMAs on the semaphore went to landed whole, in a
    ``lax.cond``: every element still marked with the semaphore. (Marks are never
    more than the bytes started on the semaphore and not landed, so that is
    landing what is pending; no byte counters are kept.)"""
    cells = sorted(
        {d for s, d in interp.dma_sites if s == sem.cell and _shadowed(interp, d)}
        | ({dst_view.cell} if _shadowed(interp, dst_view.cell) else set())
    )
    if not cells:  # no DMA on this semaphore went through a shadow: nothing to land
        return
    code = _sem_code(interp, sem, eqn)
    landed = np.int32(0)
    if _shadowed(interp, dst_view.cell):
        with interp.unchecked():  # on a TPU the wait's descriptor names no memory: nothing to bound-check
            dv = dma_view(interp, dst_view, eqn, "DMA wait")
            shadow, pending = interp.shadows[dv.cell]
            region = flat_region(interp, dv, eqn, "read")
            new, mark, n = _land_view(interp, eqn, dv, shadow, pending, region, code)
            write(interp, dv, new, eqn, region=region)
            write(interp, dv, mark, eqn, cell=pending, region=region)
        landed = lax.mul(n, np.int32(np.dtype(interp.state[dv.cell].dtype).itemsize))

    def land_all(vals, shadows):
        return [_land(sh, mark, cur, code)[:2] for (cur, mark), sh in zip(vals, shadows)]

    # Flat, as the companions are (see Interpreter.new_cell): buffers of one size then share
    # the kernels of the landing.
    vals = [(_flat(interp.state[c]), interp.state[interp.shadows[c][1]]) for c in cells]
    shadows = [interp.state[interp.shadows[c][0]] for c in cells]
    short = lax.lt(landed, jnp.asarray(nbytes, jnp.int32))
    vals = lax.cond(short, land_all, lambda vals, shadows: [tuple(v) for v in vals], vals, shadows)
    for c, (new, mark) in zip(cells, vals):
        interp.state[c] = lax.reshape(new, interp.state[c].shape)
        interp.state[interp.shadows[c][1]] = mark


def _dma_wait(interp, eqn, *ops):
    layout, v = _dma_parts(eqn, ops)
    which = eqn.params["which"]
    if which == "send":
        interp.remote_dma_wait(eqn, v, layout, which)
        return []
    nbytes = dma_nbytes(interp, v["src"], eqn)
    interp.dma_receive(eqn, v["dst_sem"], v["dst"], nbytes, remote=layout.device_id_tree is not None)
    interp.sem_wait(v["dst_sem"], nbytes, eqn, what="DMA semaphore")
    if interp.params.dma_execution_mode == "on_wait" and v["dst_sem"].cell in interp.shadows:
        _commit_pending(interp, eqn, v["dst_sem"], v["dst"], nbytes)
    if which == "dst":
        interp.on_dma_wait(eqn, v)
    return []


interpret_rules.STATE_RULES[tpu_prims.dma_start_p] = _dma_start
interpret_rules.STATE_RULES[tpu_prims.dma_wait_p] = _dma_wait
