"""TPU-only primitives: DMAs (local and remote) and the barrier semaphore.

A DMA is described by an ``AsyncCopyDescriptor`` (source view, destination
view, the semaphore(s) it signals, and for remote copies the target device).
``dma_start_p`` and ``dma_wait_p`` take the same flat operands, in this order:
src Ref, src transform leaves, dst Ref, dst transform leaves, dst semaphore,
its transform leaves, [src semaphore, its transform leaves], [device id
leaves]; the params hold the treedefs that split them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Effect, Primitive
from jax.interpreters import mlir

from pallas import backend as plb
from pallas_tpu._src import compat

DeviceIdType = compat.DeviceIdType
DMA = plb.SemaphoreKind.DMA


def _err(cls, msg):
    return plb.kernel_error(cls, msg)


@dataclasses.dataclass(frozen=True)
class DmaOperands:
    """The static layout of a DMA's flat operand list."""

    src_tree: Any
    dst_tree: Any
    dst_sem_tree: Any
    src_sem_tree: Any  # None for a local copy
    device_id_tree: Any  # None for a local copy
    device_id_type: Any
    # The copy's shape in Mosaic where it covers whole memory tiles of an array's edge
    # (``emit_pipeline``'s last block of a dimension that its block does not divide): the
    # lowering widens the last window of src and dst to it, reading and writing the edge
    # tile's padding, as JAX's pipeline copies such blocks. Interpret mode copies the views.
    padded_shape: tuple[int, ...] | None = None
    # The same for a copy of traced size (``emit_pipeline``'s ``pl.BoundedSlice`` blocks):
    # per dim of the last window of src and dst that is not squeezed, the multiple Mosaic
    # rounds its size up to (1: as is). Interpret mode copies the views.
    padded_tiling: tuple[int, ...] | None = None

    def split(self, flat):
        """flat operands -> dict of (ref, leaves) pairs and device id leaves."""
        flat = list(flat)
        out = {}

        def take(name, tree):
            ref = flat.pop(0)
            n = tree.num_leaves
            leaves, flat[:] = flat[:n], flat[n:]
            out[name] = (ref, leaves)

        take("src", self.src_tree)
        take("dst", self.dst_tree)
        take("dst_sem", self.dst_sem_tree)
        if self.src_sem_tree is not None:
            take("src_sem", self.src_sem_tree)
        out["device_id"] = flat
        return out


dma_start_p = Primitive("dma_start")
dma_start_p.multiple_results = True
dma_wait_p = Primitive("dma_wait")
dma_wait_p.multiple_results = True


def _dma_abstract_eval(*avals, layout: DmaOperands, **_):
    # Reads src, writes dst and both semaphores.
    n_src = 1 + layout.src_tree.num_leaves
    n_dst = 1 + layout.dst_tree.num_leaves
    effects = {compat.ReadEffect(0), compat.WriteEffect(n_src), compat.WriteEffect(n_src + n_dst)}
    if layout.src_sem_tree is not None:
        effects.add(compat.WriteEffect(n_src + n_dst + 1 + layout.dst_sem_tree.num_leaves))
    return [], effects


dma_start_p.def_effectful_abstract_eval(_dma_abstract_eval)
dma_wait_p.def_effectful_abstract_eval(_dma_abstract_eval)


def _view_aval(ref, leaves, tree):
    return plb.transformed_aval(compat.get_aval(ref), plb.unflatten_transforms(tree, leaves))


def _check_sem(sem, what: str):
    base, leaves, tree = plb.flatten_ref(sem, what)
    kind = plb.semaphore_kind(compat.get_aval(base))
    if kind is not DMA:
        got = (
            f"a {kind.name} semaphore"
            if kind is not None
            else f"a Ref in {compat.get_aval(base).memory_space}"
        )
        # JAX's words follow ours (its TPU interpret mode refuses a regular semaphore at the wait).
        jax_says = (
            "; dma_wait requires a DMA semaphore, but got a regular semaphore (wait on a regular "
            "semaphore with pl.semaphore_wait())"
            if kind is not None and kind.name == "REGULAR"
            else ""
        )
        raise _err(
            plb.ValueOrTypeError,
            f"{what}: DMAs signal DMA semaphores (pltpu.SemaphoreType.DMA), got {got}{jax_says}",
        )
    shape = tuple(_view_aval(base, leaves, tree).shape)
    if shape != ():
        raise _err(
            ValueError,
            f"{what}: Cannot signal on a non-()-shaped semaphore: {shape}; a DMA signals one DMA "
            "semaphore: index the array (sem.at[i])",
        )
    return base, leaves, tree


def _zero_stride_dim(transforms) -> int | None:
    """The dimension a ``pl.ds(start, size, 0)`` of a Ref view's indexers slices, if any."""
    for t in transforms:
        for d, idx in enumerate(getattr(t, "indices", ())):
            stride = getattr(idx, "stride", None)
            if isinstance(stride, (int, np.integer)) and stride == 0 and hasattr(idx, "start"):
                return d
    return None


def _same_shape(a, b) -> bool:
    """Equal shapes; a traced size (``pl.ds(i, n)``) matches any size of the
    other view (TPU interpret mode checks the values when the DMA runs)."""
    if len(a) != len(b):
        return False
    return all(x == y for x, y in zip(a, b) if isinstance(x, int) and isinstance(y, int))


def _bound_mesh_axes() -> tuple[str, ...]:
    return tuple(compat.bound_axis_names())


class AsyncCopyDescriptor:
    """A DMA from ``src`` to ``dst`` that signals ``dst_sem`` when it lands
    (and ``src_sem`` when a remote copy has left this device).

    ``start()`` issues it; ``wait()`` (local), ``wait_send()`` and
    ``wait_recv()`` (remote) block until it completes.
    """

    def __init__(
        self, src, dst, dst_sem, src_sem=None, device_id=None, device_id_type=DeviceIdType.MESH, *, what
    ):
        self.what = what
        self._choices = None
        if isinstance(src, plb.SelectedRef) or isinstance(dst, plb.SelectedRef):
            self._select(src, dst, dst_sem, src_sem, device_id, device_id_type)
            return
        s_ref, s_leaves, s_tree = plb.flatten_ref(src, f"{what} src_ref")
        d_ref, d_leaves, d_tree = plb.flatten_ref(dst, f"{what} dst_ref")
        s_aval = _view_aval(s_ref, s_leaves, s_tree)
        d_aval = _view_aval(d_ref, d_leaves, d_tree)
        for name, r in (("src_ref", s_ref), ("dst_ref", d_ref)):
            if plb.semaphore_kind(compat.get_aval(r)) is not None:
                raise _err(TypeError, f"{what}: {name} is a semaphore; DMAs copy data Refs")
        for name, leaves, tree in (("src_ref", s_leaves, s_tree), ("dst_ref", d_leaves, d_tree)):
            dim = _zero_stride_dim(plb.unflatten_transforms(tree, leaves))
            if dim is not None:
                raise _err(
                    ValueError,
                    f"{what}: {name} is a view through pl.ds(start, size, stride=0) (dimension {dim}), one "
                    "element named size times; a DMA copies distinct elements: copy the element once "
                    "(pl.ds(start, 1)) and broadcast it after the copy (a zero-stride read of the VMEM buffer)",
                )
        if not _same_shape(s_aval.shape, d_aval.shape) or s_aval.dtype != d_aval.dtype:
            raise _err(
                ValueError,
                f"{what}: src_ref and dst_ref must have the same shape and dtype, got "
                f"src {s_aval.dtype}{list(s_aval.shape)} and dst {d_aval.dtype}{list(d_aval.shape)}",
            )
        ds_ref, ds_leaves, ds_tree = _check_sem(
            dst_sem, f"{what} {'recv_sem' if src_sem is not None else 'sem'}"
        )
        flat = [s_ref, *s_leaves, d_ref, *d_leaves, ds_ref, *ds_leaves]
        ss_tree = None
        if src_sem is not None:
            ss_ref, ss_leaves, ss_tree = _check_sem(src_sem, f"{what} send_sem")
            flat += [ss_ref, *ss_leaves]
        dev_tree = None
        if device_id is not None:
            if not _bound_mesh_axes():
                raise _err(
                    ValueError,
                    f"{what}: a remote copy (device_id={device_id!r}) needs devices to copy between: call "
                    "the kernel inside jax.shard_map over a mesh (no mesh axes are bound here)",
                )
            dev, dev_tree = plb.flatten_device_id(device_id, device_id_type, what)
            flat += dev
        self.flat = flat
        self.layout = DmaOperands(s_tree, d_tree, ds_tree, ss_tree, dev_tree, device_id_type)
        self.shape, self.dtype = tuple(s_aval.shape), s_aval.dtype
        self.is_remote = device_id is not None

    def _select(self, src, dst, dst_sem, src_sem, device_id, device_id_type):
        """A DMA whose src or dst is a ``pl.select_ref``: one descriptor per choice,
        the one the index names started (a ``lax.switch``, as JAX's lowering branches);
        the wait, which only counts bytes, is the first choice's (all are alike)."""
        srcs = src.refs if isinstance(src, plb.SelectedRef) else (src,)
        dsts = dst.refs if isinstance(dst, plb.SelectedRef) else (dst,)
        for name, refs in (("src_ref", srcs), ("dst_ref", dsts)):
            kinds = []
            for r in refs:
                base, leaves, tree = plb.flatten_ref(r, f"{self.what} {name}")
                aval = _view_aval(base, leaves, tree)
                kinds.append(
                    (tuple(aval.shape), np.dtype(aval.dtype).name, str(compat.get_aval(base).memory_space))
                )
            if len(set(kinds)) > 1:
                shown = ", ".join(f"{d}{list(s)} in {m}" for s, d, m in dict.fromkeys(kinds))
                raise _err(
                    TypeError,
                    f"{self.what}: Cannot select from Refs of different types: the {name} choices of "
                    f"pl.select_ref must have one shape, dtype and memory space, got {shown}",
                )
        options = [
            [
                AsyncCopyDescriptor(s, d, dst_sem, src_sem, device_id, device_id_type, what=self.what)
                for d in dsts
            ]
            for s in srcs
        ]
        first = options[0][0]
        self.__dict__.update({k: v for k, v in first.__dict__.items() if k != "what"})
        src_idx = src.idx if isinstance(src, plb.SelectedRef) else None
        dst_idx = dst.idx if isinstance(dst, plb.SelectedRef) else None
        self._choices = (src_idx, dst_idx, options)

    def _start_selected(self, priority: int, add: bool) -> None:
        src_idx, dst_idx, options = self._choices

        def branch(idx, fns):
            if idx is None:
                return fns[0]()
            # JAX's lowering tests idx == 0, == 1, ... in turn: any other value takes the last.
            idx = jnp.where((idx < 0) | (idx >= len(fns)), len(fns) - 1, idx)
            lax.switch(idx, fns)

        def start_row(row):
            branch(dst_idx, [lambda o=o: o.start(priority=priority, add=add) for o in row])

        branch(src_idx, [lambda row=row: start_row(row) for row in options])

    @property
    def nbytes(self):
        """The bytes the DMA moves: an int, or a traced int32 when a size is traced."""
        n = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        return n if isinstance(n, int) else jnp.asarray(n, jnp.int32)

    def start(self, priority: int = 0, add: bool = False) -> None:
        """Issues the DMA; ``add=True`` adds into the destination."""
        if add and self.is_remote:
            raise _err(NotImplementedError, f"{self.what}: remote DMAs that add (add=True) are not supported")
        self._add = bool(add)
        if self._choices is not None:
            self._start_selected(int(priority), bool(add))
            return
        dma_start_p.bind(*self.flat, layout=self.layout, priority=int(priority), add=bool(add))

    def _wait(self, which: str) -> None:
        # A DMA that executes when waited on (interpret mode "on_wait") must know it adds.
        dma_wait_p.bind(*self.flat, layout=self.layout, which=which, add=getattr(self, "_add", False))

    def wait(self) -> None:
        if self.is_remote:  # as JAX: this device's send, then the receive of the copy sent to it
            self._wait("send")
            self._wait("recv")
            return
        self._wait("dst")

    def wait_recv(self) -> None:
        if not self.is_remote:
            raise _err(TypeError, f"{self.what}: wait_recv() is for remote copies; use wait()")
        self._wait("recv")

    def wait_send(self) -> None:
        if not self.is_remote:
            raise _err(TypeError, f"{self.what}: wait_send() is for remote copies; use wait()")
        self._wait("send")


def make_async_copy(src_ref, dst_ref, sem) -> AsyncCopyDescriptor:
    """A local DMA from ``src_ref`` to ``dst_ref`` (Refs or ``.at[...]`` views
    of equal shape and dtype) signalling the DMA semaphore ``sem``.

    Returns:
      An ``AsyncCopyDescriptor``: call ``.start()`` then ``.wait()``.
    """
    return AsyncCopyDescriptor(src_ref, dst_ref, sem, what="pltpu.make_async_copy")


def make_async_remote_copy(
    src_ref, dst_ref, send_sem, recv_sem, device_id, device_id_type: DeviceIdType = DeviceIdType.MESH
) -> AsyncCopyDescriptor:
    """A DMA from ``src_ref`` on this device to ``dst_ref`` on ``device_id``.

    Args:
      src_ref, dst_ref: Refs or views of equal shape and dtype.
      send_sem: DMA semaphore on this device, signalled when the data has left.
      recv_sem: DMA semaphore on the target, signalled when the data landed.
      device_id: the target device (mesh coordinates or a logical id).
      device_id_type: ``pl.DeviceIdType.MESH`` or ``LOGICAL``.
    Returns:
      An ``AsyncCopyDescriptor``: ``.start()``, ``.wait_send()``, ``.wait_recv()``.
    """
    return AsyncCopyDescriptor(
        src_ref, dst_ref, recv_sem, send_sem, device_id, device_id_type, what="pltpu.make_async_remote_copy"
    )


def async_copy(src_ref, dst_ref, sem, *, priority: int = 0, add: bool = False) -> AsyncCopyDescriptor:
    """Starts a local DMA (adding into ``dst_ref`` with ``add=True``) and
    returns its descriptor (wait on it later)."""
    copy = make_async_copy(src_ref, dst_ref, sem)
    copy.start(priority=priority, add=add)
    return copy


def async_remote_copy(src_ref, dst_ref, send_sem, recv_sem, device_id, device_id_type=DeviceIdType.MESH):
    """Starts a remote DMA and returns its descriptor."""
    copy = make_async_remote_copy(src_ref, dst_ref, send_sem, recv_sem, device_id, device_id_type)
    copy.start()
    return copy


# ---------------------------------------------------------------------------
# The barrier semaphore: one per kernel, shared by the devices of a collective.

get_barrier_semaphore_p = Primitive("get_barrier_semaphore")


def get_barrier_semaphore():
    """The kernel's barrier semaphore (a BARRIER semaphore Ref), for
    synchronizing devices: signal it on the neighbours, then wait on it.
    Needs ``pltpu.CompilerParams(collective_id=...)``."""
    return get_barrier_semaphore_p.bind()


get_barrier_semaphore_p.def_abstract_eval(
    lambda: compat.ref_aval((), jnp.int32, plb.SemaphoreSpace(plb.SemaphoreKind.BARRIER))
)


__all__ = [
    "AsyncCopyDescriptor",
    "async_copy",
    "async_remote_copy",
    "get_barrier_semaphore",
    "make_async_copy",
    "make_async_remote_copy",
]


# ---------------------------------------------------------------------------
# Masked vector loads and stores.


def _check_mask(ref, mask, what):
    shape = tuple(ref.shape)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ or tuple(mask.shape) != shape:
        raise _err(
            ValueError,
            f"{what}: mask must be a bool array of the Ref's shape {shape}, got {mask.dtype}{list(mask.shape)}",
        )
    return mask


def load(ref, *, mask=None):
    """Loads the whole of ``ref`` (a Ref or a view); with ``mask``, the masked-out
    elements are unspecified on a TPU (zero here).

    Args:
      ref: the Ref to load from.
      mask: optional bool array of the Ref's shape: which elements to load.
    Returns:
      The loaded array.
    """
    with jax.named_scope("pltpu.load"):  # checks.LOAD_SCOPE: JAX's messages say load_p for it
        val = ref[...]
    if mask is None:
        return val
    return jnp.where(_check_mask(ref, mask, "pltpu.load"), val, jnp.zeros_like(val))


def store(ref, val, *, mask=None) -> None:
    """Stores ``val`` into ``ref``; with ``mask``, only where the mask is true.

    Args:
      ref: the Ref to store to.
      val: the value (the Ref's shape).
      mask: optional bool array of the Ref's shape.
    """
    if mask is None:
        ref[...] = val
        return
    mask = _check_mask(ref, mask, "pltpu.store")
    ref[...] = jnp.where(mask, jnp.asarray(val, ref.dtype), ref[...])


# ---------------------------------------------------------------------------
# The TensorCore's P-state (JAX 0.12.1): a request for another clock frequency.


class RequestPStateEffect(Effect):
    """Keeps ``pltpu.request_p_state`` (no operands, no results) in the kernel."""


request_p_state_effect = RequestPStateEffect()
compat.allow_effect_in_kernels(RequestPStateEffect)

request_p_state_p = Primitive("request_p_state")
request_p_state_p.multiple_results = True


@request_p_state_p.def_effectful_abstract_eval
def _request_p_state_abstract_eval(*, p_state: int):
    if p_state < 0:
        raise _err(ValueError, f"pltpu.request_p_state: p_state must be non-negative, got {p_state}")
    return [], {request_p_state_effect}


def request_p_state(p_state: int) -> None:
    """Asks the TensorCore for P-state ``p_state`` (its clock frequency; other parts
    of the chip may follow it), as JAX's ``pltpu.request_p_state``: best effort and
    not immediate (the hardware or firmware may ignore, delay or clamp the request).

    Lowered for TPU7x and later (Mosaic's ``tpu.request_p_state``, jaxlib >= 0.12.1);
    older chips refuse it. Interpret modes take it and do nothing: a P-state
    changes how fast a kernel runs, not what it computes.

    Args:
      p_state: the P-state index, a non-negative Python int.
    """
    if not isinstance(p_state, (int, np.integer)) or isinstance(p_state, bool):
        raise _err(
            TypeError,
            f"pltpu.request_p_state: p_state must be an int, got {type(p_state)} (a static P-state index)",
        )
    request_p_state_p.bind(p_state=int(p_state))


def _request_p_state_nothing(ctx, *, p_state):
    """Outside a TPU lowering (pallas-core's interpret mode lowers the kernel's jaxpr
    for the CPU): nothing to do."""
    del ctx, p_state
    return []


mlir.register_lowering(request_p_state_p, _request_p_state_nothing)
