"""Running many programs of an interpreted Triton kernel at once.

Triton's interpreter runs one program at a time, each a few hundred Python
calls over small NumPy arrays: about a millisecond per program, whatever the
block size. ``run_chunk`` runs a contiguous range of programs (in grid order)
in one pass instead: ``tl.program_id`` returns a vector, and every value that
depends on it carries a leading *program axis* of length P (a scalar becomes
``(P, 1)``, a ``[M, N]`` block ``(P, M, N)``); values that do not depend on it
keep their usual shape and broadcast. One pass costs about as much as one
program, so the launch runs P times faster.

Which values are batched: every ``TensorHandle`` that holds program-dependent
data is tagged (``_jkr_batched``) by the builder operation that made it;
``tl.tensor(handle, type)`` checks the tag against the data's shape (a
handle made outside the builder, e.g. by a reduction, gets its tag there),
and a mismatch abandons the pass.

A pass is abandoned, its stores undone, and the programs are run one by one
(``Unbatchable``) when running them together could differ from running them in
order: control flow that differs between programs (``if pid == 0``, loop
bounds, ``int(x)``), atomics, ``tl.device_print``, block pointers or tensor
descriptors with program-dependent offsets, reductions and scans other than
sum/min/max/argmin/argmax/cumsum/cumprod and those whose combine function is
one NumPy ufunc (``_combine``), any operation this module does not
know, an out-of-bounds access or a failed ``device_assert`` (the one-by-one
run then raises the error naming the program), and memory that one program
writes and another reads or writes in the same pass (on a GPU a race; in
order, later programs see earlier stores). Stores are applied at once (a
program reads its own stores back) and logged with the old values, so
abandoning restores memory exactly.
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

import numpy as np

from jax_kernel_runtime.triton import _combine, _state
from jax_kernel_runtime.triton._conflicts import conflicts
from jax_kernel_runtime.triton._state import interpreter

_TAG = "_jkr_batched"


class Unbatchable(Exception):
    """The running pass cannot continue batched; ``permanent``: no pass of
    this launch can (an operation, not the data, is the reason)."""

    def __init__(self, reason: str, permanent: bool = False):
        super().__init__(reason)
        self.permanent = permanent


class _Pass:
    """The programs of one batched pass and what it did to memory."""

    def __init__(self, coords: np.ndarray):
        self.coords = coords  # (P, 3) int32 program ids, in grid order
        self.size = coords.shape[0]
        self.undo: list[tuple[np.ndarray, np.ndarray]] = []  # (pointers, old values)
        self.accesses: list[tuple] = []  # (pointers, program or None: all, element bytes, is_store)
        self.elements_per_program = 1  # largest batched value seen, per program


_active: _Pass | None = None


def _batched(h: Any) -> bool:
    if isinstance(h, (list, tuple)):
        return any(_batched(x) for x in h)
    return bool(getattr(h, _TAG, False))


def _tag(out: Any, value: bool = True) -> Any:
    if isinstance(out, (list, tuple)):
        for x in out:
            _tag(x, value)
    elif hasattr(out, "data") and isinstance(out.data, np.ndarray):
        setattr(out, _TAG, value)
        if value and _active is not None:
            per = out.data.size // max(1, _active.size)
            _active.elements_per_program = max(_active.elements_per_program, per)
    return out


def _handle(data: np.ndarray, dtype, batched: bool):
    return _tag(interpreter().TensorHandle(data, dtype), batched)


def _lift(h) -> np.ndarray:
    """The data of ``h`` with the program axis (unbatched data is repeated)."""
    if _batched(h):
        return h.data
    return np.broadcast_to(h.data, (cast(_Pass, _active).size, *h.data.shape))  # called within a pass


# ---------------------------------------------------------------------------
# Builder operations


# Elementwise operations: NumPy broadcasting of (P, *shape) against shape (the
# semantic layer makes operands of one shape first) gives the right result;
# the output is batched when an input is.
_ELEMENTWISE = (
    "binary_op ternary_op unary_op cast_impl create_idiv create_ashr create_umulhi create_fma "
    "create_fabs create_erf create_rsqrt create_fp_to_fp create_bitcast create_addptr create_dot "
    "create_si_to_fp create_ui_to_fp create_fp_to_si create_fp_to_ui create_fp_ext create_fp_trunc "
    "create_int_cast create_fadd create_fmul create_fdiv create_frem create_fsub create_mul "
    "create_precise_divf create_sdiv create_udiv create_srem create_urem create_add create_sub "
    "create_shl create_lshr create_minsi create_minui create_minimumf create_minnumf create_maxsi "
    "create_maxui create_maximumf create_maxnumf create_icmpSLE create_icmpSLT create_icmpSGE "
    "create_icmpSGT create_icmpULE create_icmpULT create_icmpUGE create_icmpUGT create_icmpEQ "
    "create_icmpNE create_fcmpOLT create_fcmpOGT create_fcmpOLE create_fcmpOGE create_fcmpOEQ "
    "create_fcmpONE create_fcmpULT create_fcmpUGT create_fcmpULE create_fcmpUGE create_fcmpUEQ "
    "create_fcmpUNE create_and create_xor create_or create_int_to_ptr create_ptr_to_int "
    "create_clampf create_select create_cos create_exp create_exp2 create_iabs create_floor "
    "create_ceil create_log create_log2 create_precise_sqrt create_sqrt create_sin create_split "
    "create_assert create_assume create_barrier"
).split()
# Operations that only call others (which do the batching).
_DELEGATING = ("create_tensor_pointer_load", "create_tensor_pointer_store")
# Operations that run in program order or print per program: never batched.
_NEVER = ("create_atomic_rmw", "create_atomic_cas", "create_print")


def _elementwise(original):
    def op(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if _active is not None and (_batched(args) or _batched(tuple(kwargs.values()))):
            _tag(out)
        return out

    return op


def _unknown(name: str, original):
    def op(self, *args, **kwargs):
        if _active is not None and (_batched(args) or _batched(tuple(kwargs.values()))):
            raise Unbatchable(f"{name} of a program-dependent value", permanent=True)
        return original(self, *args, **kwargs)

    return op


def _never(name: str, original):
    def op(self, *args, **kwargs):
        if _active is not None:
            raise Unbatchable(name, permanent=True)
        return original(self, *args, **kwargs)

    return op


def _shape_op(original, batched_op):
    def op(self, *args):
        if _active is None or not _batched(args):
            return original(self, *args)
        return batched_op(*args)

    return op


def _splat(ret_ty, arg):
    shape = tuple(ret_ty.shape)
    first = arg.data.reshape(_active.size, -1)[:, 0].reshape((_active.size,) + (1,) * len(shape))
    data = np.broadcast_to(first, (_active.size, *shape)).copy()
    return _handle(data, arg.dtype.scalar, True)


def _unsplat(arg):
    return _handle(arg.data.reshape(_active.size, -1)[:, :1].copy(), arg.dtype.scalar, True)


def _broadcast(arg, shape):
    return _handle(np.broadcast_to(arg.data, (_active.size, *shape)), arg.dtype.scalar, True)


def _reshape(arg, shape, allow_reorder=False):
    return _handle(arg.data.reshape((_active.size, *shape)), arg.dtype.scalar, True)


def _expand_dims(arg, axis):
    axis = axis + 1 if axis >= 0 else axis
    return _handle(np.expand_dims(arg.data, axis), arg.dtype.scalar, True)


def _trans(arg, perm):
    return _handle(np.transpose(arg.data, [0, *(p + 1 for p in perm)]), arg.dtype.scalar, True)


def _cat(lhs, rhs):
    return _handle(np.concatenate([_lift(lhs), _lift(rhs)], axis=1), lhs.dtype.scalar, True)


def _join(lhs, rhs):
    a, b = np.broadcast_arrays(_lift(lhs), _lift(rhs))
    return _handle(np.stack([a, b], axis=-1), lhs.dtype.scalar, True)


def _gather(src, indices, axis):
    s, i = _lift(src), _lift(indices)
    return _handle(np.take_along_axis(s, i, axis=axis + 1), src.dtype.scalar, True)


def _get_program_id(self, axis):
    if _active is None:
        return _BUILDER_ORIGINALS["create_get_program_id"](self, axis)
    ids = _active.coords[:, axis]
    if (ids == ids[0]).all():  # e.g. a grid axis of size 1: the same for every program
        return _handle(np.array([ids[0]], np.int32), _tl().int32, False)
    return _handle(ids.reshape(-1, 1).astype(np.int32), _tl().int32, True)


# ---------------------------------------------------------------------------
# Memory


def _record(ptrs: np.ndarray, mask: np.ndarray, batched: bool, elem_bytes: int, store: bool) -> None:
    active = cast(_Pass, _active)  # called within a pass
    p = ptrs[mask]
    if p.size == 0:
        return
    program = None
    if batched:
        rows = np.arange(active.size, dtype=np.int32).reshape((-1,) + (1,) * (ptrs.ndim - 1))
        program = np.broadcast_to(rows, ptrs.shape)[mask]
    active.accesses.append((p, program, elem_bytes, store))


def _dense(x: np.ndarray, dtype=None) -> np.ndarray:
    """A C-contiguous, writable array (Triton's load and store need both)."""
    return np.require(x, dtype, ["C", "W"])


def _spread(h, batched: bool, shape, dtype=None) -> np.ndarray:
    """Handle ``h``'s values (per program where ``batched``) broadcast to ``shape``, dense."""
    return _dense(np.broadcast_to(_lift(h) if batched else h.data, shape), dtype)


def _operands(ptrs, mask, extra):
    """(batched, shape, pointers, mask) with the operands broadcast to one shape."""
    handles = [h for h in (ptrs, mask, extra) if h is not None]
    batched = _batched(handles)
    shape = np.broadcast_shapes(*((_lift(h) if batched else h.data).shape for h in handles))
    p = _spread(ptrs, batched, shape)
    if mask is None:
        return batched, shape, p, np.ones(shape, bool)
    return batched, shape, p, _spread(mask, batched, shape, bool)


def _access(ptrs, mask, extra, *, store: bool):
    """``_operands`` of a load or store, checked and recorded; with the element type."""
    batched, shape, p, m = _operands(ptrs, mask, extra)
    elem = ptrs.get_element_ty()
    elem_bytes = max(1, elem.primitive_bitwidth // 8)
    _state.check_access("store" if store else "load", p, m, elem_bytes)
    _record(p, m, batched, elem_bytes, store=store)
    return batched, shape, p, m, elem


def _load(self, ptr, *policy, **policy_kw):  # *policy, **policy_kw: as in _patches._masked_load
    if _active is None:
        return _BUILDER_ORIGINALS["create_load"](self, ptr, *policy, **policy_kw)
    return _masked_load(self, ptr, None, None, *policy, **policy_kw)


def _store(self, ptr, value, *policy, **policy_kw):
    if _active is None:
        return _BUILDER_ORIGINALS["create_store"](self, ptr, value, *policy, **policy_kw)
    return _masked_store(self, ptr, value, None, *policy, **policy_kw)


def _mask_handle(mask):
    """Block pointers pass their mask as a bare array (always the same for
    every program: their offsets are not program-dependent here)."""
    if isinstance(mask, np.ndarray):
        return interpreter().TensorHandle(mask, _tl().int1)
    return mask


def _masked_load(self, ptrs, mask, other, *policy, **policy_kw):  # *policy: as in _patches
    mask = _mask_handle(mask)
    if _active is None:
        return _BUILDER_ORIGINALS["create_masked_load"](self, ptrs, mask, other, *policy, **policy_kw)
    interp = interpreter()
    batched, shape, p, m, elem = _access(ptrs, mask, other, store=False)
    dtype = interp._get_np_dtype(elem)
    o = np.zeros(shape, dtype) if other is None else _spread(other, batched, shape, dtype)
    data = interp._interpreter.load(p, m, o, dtype)
    return _handle(data, elem, batched)


def _masked_store(self, ptrs, value, mask, *policy, **policy_kw):
    mask = _mask_handle(mask)
    if _active is None:
        return _BUILDER_ORIGINALS["create_masked_store"](self, ptrs, value, mask, *policy, **policy_kw)
    interp = interpreter()
    batched, shape, p, m, _ = _access(ptrs, mask, value, store=True)
    v = _spread(value, batched, shape)
    old = interp._interpreter.load(p, m, np.zeros(shape, v.dtype), v.dtype)
    _active.undo.append((p[m], old[m]))
    return interp._interpreter.store(p, v, m)


def _block_pointer(name: str, original):
    def op(self, *args):
        if _active is not None and (
            _batched(list(args)) or (name == "create_advance" and _batched(args[0].offsets))
        ):
            raise Unbatchable(f"{name} with program-dependent offsets")
        return original(self, *args)

    return op


# ---------------------------------------------------------------------------
# Language-level patches: tensors, control flow, reductions


def _tl():
    import triton.language as tl

    return tl


_original_tensor_init = None


def _tensor_init(self, handle, type):
    _original_tensor_init(self, handle, type)
    if _active is None or not isinstance(getattr(handle, "data", None), np.ndarray):
        return
    data = handle.data
    if type.is_block():
        plain = data.shape == tuple(type.shape)
        batched = data.shape == (_active.size, *type.shape)
    else:
        plain = data.size == 1
        batched = data.shape == (_active.size, 1)
    tag = getattr(handle, _TAG, None)
    if batched == plain or (tag is not None and bool(tag) != batched):
        raise Unbatchable(f"a {type} value with data of shape {data.shape}")
    if tag is None:
        _tag(handle, batched)


def _uniform(self) -> Any:
    """The one value every program of the pass has for scalar ``self``."""
    per = self.handle.data.reshape(cast(_Pass, _active).size, -1)  # called within a pass
    values = per[:, 0]
    if per.shape[1] != 1 or not (values == values[0]).all():
        raise Unbatchable("control flow that differs between programs")
    return values[0]


def _as_bool(self) -> bool:
    if _active is not None and _batched(self.handle):
        if self.handle.data.size != _active.size:
            return True  # a block: as Triton's interpreter
        return bool(_uniform(self))
    data = self.handle.data
    return bool(data.reshape(-1)[0]) if data.size == 1 else True


def _as_index(self) -> int:
    if _active is not None and _batched(self.handle):
        return int(_uniform(self))
    return int(self.handle.data.reshape(-1)[0])


def _transpose(self):
    tl = _tl()
    data = self.handle.data
    batched = _active is not None and _batched(self.handle)
    axes = [0, *reversed(range(1, data.ndim))] if batched else list(reversed(range(data.ndim)))
    shape = list(self.type.shape)
    shape[-1], shape[-2] = shape[-2], shape[-1]
    return tl.core.tensor(
        _handle(np.transpose(data, axes), self.handle.dtype, batched), tl.block_type(self.dtype, shape)
    )


def _to_tensor(data: np.ndarray, dtype):
    """A batched result of shape (P, *shape) as a tensor of ``shape``."""
    tl = _tl()
    interp = interpreter()
    data = data.astype(interp._get_np_dtype(dtype))
    shape = data.shape[1:]
    if not shape:
        return tl.core.tensor(_handle(data.reshape(-1, 1), dtype.scalar, True), dtype)
    return tl.core.tensor(_handle(data, dtype.scalar, True), tl.block_type(dtype, list(shape)))


def _axis(data: np.ndarray, axis):
    if axis is None:
        return data.reshape(data.shape[0], -1), 1
    axis = int(getattr(axis, "value", axis))
    return data, (axis + data.ndim - 1 if axis < 0 else axis) + 1


def _combining(input, combine_fn):
    """``(inputs, ufunc, same)`` of a reduction or scan: its tensors, the NumPy ufunc of
    ``combine_fn`` (or None), and whether every program has the same values."""
    inputs = input if isinstance(input, tuple) else (input,)
    same = _active is None or not _batched([x.handle for x in inputs])
    return inputs, _combine.ufunc_for(combine_fn, inputs), same


def _unbatched(input, inputs, ops, ufunc, whole):
    """Triton's interpreter's reduction or scan (``ops``) of ``input``, the same for every
    program; where the combine function is a NumPy ``ufunc``, ``whole(data)`` in one call."""
    if ufunc is None:
        return ops.apply(input)
    ops.check_tensor(inputs)
    value = ops.to_tensor(whole(inputs[0].handle.data), inputs[0].dtype)
    return (value,) if isinstance(input, tuple) else value


def _reduce(input, axis, combine_fn, keep_dims=False, **kwargs):
    inputs, ufunc, same = _combining(input, combine_fn)
    if same:

        def whole(data):
            ax = None if axis is None else int(getattr(axis, "value", axis))
            return ufunc.reduce(data, axis=ax, keepdims=keep_dims, dtype=data.dtype)

        return _unbatched(input, inputs, interpreter().ReduceOps(axis, combine_fn, keep_dims), ufunc, whole)
    tl = _tl()
    std = tl.standard
    x = inputs[0]
    if not _batched(x.handle):
        raise Unbatchable("a reduction with program-dependent indices")
    # JITFunctions hash by their cache key, which cannot be computed while
    # the language is patched: compare by identity.
    ops = [
        (std._sum_combine, (np.sum, None)),
        (std._elementwise_max, (np.nanmax, None)),
        (std._elementwise_min, (np.nanmin, None)),
        (std._argmax_combine_tie_break_left, (np.max, np.argmax)),
        (std._argmin_combine_tie_break_left, (np.min, np.argmin)),
    ]
    found = [op for fn, op in ops if fn is combine_fn]
    if not found and ufunc is not None:
        found = [
            (lambda d, axis, keepdims: ufunc.reduce(d, axis=axis, keepdims=keepdims, dtype=d.dtype), None)
        ]
    if not found:
        raise Unbatchable(f"a reduction with combine function {getattr(combine_fn, '__name__', combine_fn)}")
    value_op, index_op = found[0]
    data, ax = _axis(x.handle.data, axis)
    ndim = x.handle.data.ndim - 1

    def shaped(r):
        return r.reshape((r.shape[0],) + (1,) * ndim) if keep_dims and axis is None else r

    value = _to_tensor(shaped(value_op(data, axis=ax, keepdims=keep_dims)), x.dtype)
    if index_op is None:
        return value if not isinstance(input, tuple) else (value,)
    index = _to_tensor(shaped(index_op(data, axis=ax, keepdims=keep_dims)), tl.int32)
    return value, index


def _scan(input, axis, combine_fn, reverse=False, **kwargs):
    inputs, ufunc, same = _combining(input, combine_fn)
    if same:

        def whole(data):
            ax = int(getattr(axis, "value", axis))
            flip = (lambda d: np.flip(d, axis=ax)) if reverse else (lambda d: d)  # noqa: E731
            return flip(ufunc.accumulate(flip(data), axis=ax, dtype=data.dtype))

        return _unbatched(input, inputs, interpreter().ScanOps(axis, combine_fn, reverse), ufunc, whole)
    std = _tl().standard
    found = [
        op for fn, op in ((std._sum_combine, np.cumsum), (std._prod_combine, np.cumprod)) if fn is combine_fn
    ]
    if not found and ufunc is not None:
        found = [lambda d, axis: ufunc.accumulate(d, axis=axis, dtype=d.dtype)]
    if len(inputs) != 1 or not found:
        raise Unbatchable(f"a scan with combine function {getattr(combine_fn, '__name__', combine_fn)}")
    x = inputs[0]
    data, ax = _axis(x.handle.data, axis)
    if reverse:
        data = np.flip(data, axis=ax)
    out = found[0](data, axis=ax)
    if reverse:
        out = np.flip(out, axis=ax)
    result = _to_tensor(out, x.dtype)
    return (result,) if isinstance(input, tuple) else result


def lang_patches(scope) -> None:
    """Patches ``triton.language`` for batched passes (and for NumPy >= 2.5);
    applied again inside every nested ``@jit`` call, whose own language
    patch replaces these names."""
    tl = _tl()
    scope.set_attr(tl.core.tensor, "__index__", _as_index)
    scope.set_attr(tl.core.tensor, "__bool__", _as_bool)
    scope.set_attr(tl.core.tensor, "T", property(_transpose))
    for module in (tl, tl.core):
        scope.set_attr(module, "reduce", _reduce)
        scope.set_attr(module, "associative_scan", _scan)


_BUILDER_ORIGINALS: dict[str, Any] = {}


def builder_patches(scope) -> None:
    """Wraps every builder operation (as patched by ``_patches``) so
    that it works on, or refuses, program-dependent values."""
    global _original_tensor_init
    tl = _tl()
    builder = interpreter().InterpreterBuilder
    shape_ops = {
        "create_splat": _splat, "create_unsplat": _unsplat, "create_broadcast": _broadcast,
        "create_reshape": _reshape, "create_expand_dims": _expand_dims, "create_trans": _trans,
        "create_cat": _cat, "create_join": _join, "create_gather": _gather,
    }  # fmt: skip
    for name in dir(builder):
        if not (name.startswith("create_") or name in _ELEMENTWISE):
            continue
        original = getattr(builder, name)
        _BUILDER_ORIGINALS[name] = original
        if name in _DELEGATING:
            continue
        if name in _ELEMENTWISE:
            patched = _elementwise(original)
        elif name in shape_ops:
            patched = _shape_op(original, shape_ops[name])
        elif name in _NEVER:
            patched = _never(name, original)
        elif name in ("create_make_block_ptr", "create_advance"):
            patched = _block_pointer(name, original)
        elif name == "create_load":
            patched = _load
        elif name == "create_store":
            patched = _store
        elif name == "create_masked_load":
            patched = _masked_load
        elif name == "create_masked_store":
            patched = _masked_store
        elif name == "create_get_program_id":
            patched = _get_program_id
        else:  # make_range, num_programs, histogram, descriptors, and whatever a new Triton adds
            patched = _unknown(name, original)
        scope.set_attr(builder, name, patched)
    if _original_tensor_init is None:
        _original_tensor_init = tl.core.tensor.__init__
    scope.set_attr(tl.core.tensor, "__init__", _tensor_init)


# ---------------------------------------------------------------------------
# Running a pass


def _undo(p: _Pass) -> None:
    interp = interpreter()
    for ptrs, old in reversed(p.undo):
        interp._interpreter.store(ptrs, old, np.ones(ptrs.shape, bool))


def run_chunk(rewritten, call_args: dict, coords: np.ndarray) -> tuple[bool, bool, int]:
    """Runs the programs ``coords`` (P x 3, grid order) in one pass.

    Returns ``(done, permanent, elements_per_program)``: ``done`` False means
    memory is as before and the programs must run one by one; ``permanent``
    that later passes of this launch would fail alike.
    ``JAX_KERNEL_RUNTIME_INTERPRET_EXPLAIN=1`` prints why a pass was abandoned.
    """
    global _active
    p = _Pass(coords)
    _active = p
    reason = ""
    try:
        rewritten(**call_args)
        ok, permanent = not conflicts(p.accesses), False
        if not ok:
            reason = "a program accesses memory another program of the pass stores"
    except Unbatchable as e:
        ok, permanent, reason = False, e.permanent, str(e)
    except Exception as e:  # noqa: BLE001 - the one-by-one run raises it for the right program
        ok, permanent, reason = False, False, f"{type(e).__name__}: {e}"
    finally:
        _active = None
    if not ok:
        _undo(p)
        if os.environ.get("JAX_KERNEL_RUNTIME_INTERPRET_EXPLAIN", "") not in ("", "0"):
            print(
                f"[jax_kernel_runtime] programs {tuple(coords[0].tolist())}..{tuple(coords[-1].tolist())} "
                f"run one by one: {reason}",
                file=sys.stderr,
                flush=True,
            )
    return ok, permanent, p.elements_per_program
