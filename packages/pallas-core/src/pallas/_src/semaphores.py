"""Semaphores: ``pl.semaphore_signal``, ``pl.semaphore_wait``, ``pl.semaphore_read``.

A semaphore Ref holds int32 counters and has a ``SemaphoreSpace`` memory space
(allocated with ``pltpu.SemaphoreType.REGULAR((n,))`` and friends). The
primitives take the semaphore Ref, the leaves of its indexing transforms
(``sem.at[i]``) and their other operands; backends give them meaning (the
pallas-tpu interpreter keeps the counters, the Mosaic lowering emits
``tpu.sem_signal``...). Signals may target another device (``device_id``) or
core (``core_index``).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from pallas._src import compat, errors
from pallas._src import core as pallas_core
from pallas._src.errors import kernel_error, record_runtime_error
from pallas._src.poison import GlobalSwitch


class DeviceIdType(enum.Enum):
    """How a ``device_id`` names a device: ``MESH`` (a tuple or dict of mesh
    coordinates, one per named mesh axis) or ``LOGICAL`` (a flat index)."""

    MESH = "mesh"
    LOGICAL = "logical"


def flatten_ref(ref: Any, what: str) -> tuple[Any, list[Any], Any]:
    """(base Ref, transform leaves, transforms treedef) of a Ref or ``ref.at[...]``."""
    if isinstance(ref, compat.TransformedRef):
        leaves, tree = tree_util.tree_flatten(tuple(ref.transforms))
        return ref.ref, leaves, tree
    if not compat.is_ref_aval(_aval(ref)):
        raise kernel_error(TypeError, f"{what}: expected a Ref, got {type(ref).__name__}")
    leaves, tree = tree_util.tree_flatten(())
    return ref, leaves, tree


def unflatten_transforms(tree, leaves) -> tuple[Any, ...]:
    """The Ref transforms (``.at[...]`` views) a semaphore primitive carries flattened."""
    return tuple(tree_util.tree_unflatten(tree, list(leaves)))


def _aval(x):
    try:
        return compat.get_aval(x)
    except TypeError:
        return None


def transformed_aval(ref_aval, transforms):
    """The array aval a Ref view (``ref.at[...]``, bitcasts, reshapes) has."""
    aval = compat.shaped_array(ref_aval.shape, ref_aval.dtype)
    for t in transforms:
        aval = t.transform_type(aval)
    return aval


def transformed_shape(ref_aval, transforms) -> tuple[int, ...]:
    return tuple(transformed_aval(ref_aval, transforms).shape)


def _check_semaphore(sem, what: str, allowed: tuple[pallas_core.SemaphoreKind, ...]):
    base, leaves, tree = flatten_ref(sem, what)
    aval = _aval(base)
    kind = pallas_core.semaphore_kind(aval)
    if kind is None:
        raise kernel_error(
            TypeError,
            f"{what}: expected a semaphore Ref (e.g. from scratch_shapes=[pltpu.SemaphoreType.REGULAR]), "
            f"got a Ref of {aval.dtype}{list(aval.shape)} in memory space {aval.memory_space}",
        )
    if kind not in allowed:
        names = " or ".join(k.name for k in allowed)
        hint = (
            " (DMA semaphores are waited on with the copy descriptor's .wait())" if kind.name == "DMA" else ""
        )
        raise kernel_error(
            TypeError, f"{what}: expected a {names} semaphore, got a {kind.name} semaphore{hint}"
        )
    shape = transformed_shape(aval, unflatten_transforms(tree, leaves))
    if shape != ():
        raise kernel_error(
            ValueError,
            f"{what}: expected a single semaphore, got a view of shape {shape}; index it, e.g. sem.at[i]",
        )
    return base, leaves, tree, kind


def _int_scalar(x, what: str):
    x = jnp.asarray(x)
    if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
        raise kernel_error(TypeError, f"{what}: expected an integer scalar, got {x.dtype}{list(x.shape)}")
    return x.astype(jnp.int32)


def flatten_device_id(device_id: Any, device_id_type: DeviceIdType, what: str):
    """(leaves, treedef) of a device id: an int scalar, or a tuple/dict of
    them (mesh coordinates). None means this device."""
    if device_id is None:
        return [], None
    if not isinstance(device_id_type, DeviceIdType):
        raise kernel_error(
            TypeError, f"{what}: device_id_type must be a pl.DeviceIdType, got {device_id_type!r}"
        )
    leaves, tree = tree_util.tree_flatten(device_id)
    if device_id_type is DeviceIdType.LOGICAL and len(leaves) != 1:
        raise kernel_error(
            ValueError,
            f"{what}: a LOGICAL device_id is one integer, got {len(leaves)} values ({device_id!r})",
        )
    return [_int_scalar(v, f"{what} device_id") for v in leaves], tree


# ---------------------------------------------------------------------------

#: ``pl.semaphore_signal``.
semaphore_signal_p = Primitive("semaphore_signal")
semaphore_signal_p.multiple_results = True


def semaphore_signal(
    sem_or_view: Any,
    inc: int | jax.Array = 1,
    *,
    device_id: Any = None,
    device_id_type: DeviceIdType = DeviceIdType.MESH,
    core_index: int | jax.Array | None = None,
) -> None:
    """Adds ``inc`` to a semaphore, on this device or on ``device_id``.

    Args:
      sem_or_view: a REGULAR or BARRIER semaphore Ref (indexed to one
        semaphore, e.g. ``sems.at[0]``).
      inc: the increment (int32 scalar).
      device_id: the device whose semaphore is signalled (None: this one).
      device_id_type: ``pl.DeviceIdType.MESH`` or ``LOGICAL``.
      core_index: the core whose semaphore is signalled (None: this one).
    """
    kinds = (pallas_core.SemaphoreKind.REGULAR, pallas_core.SemaphoreKind.BARRIER)
    sem, leaves, tree, _ = _check_semaphore(sem_or_view, "pl.semaphore_signal", kinds)
    inc = _int_scalar(inc, "pl.semaphore_signal inc")
    dev, dev_tree = flatten_device_id(device_id, device_id_type, "pl.semaphore_signal")
    core = [] if core_index is None else [_int_scalar(core_index, "pl.semaphore_signal core_index")]
    semaphore_signal_p.bind(
        sem,
        *leaves,
        inc,
        *dev,
        *core,
        sem_tree=tree,
        device_id_tree=dev_tree,
        device_id_type=device_id_type,
        has_core_index=bool(core),
    )


def _signal_abstract_eval(*avals, **_):
    # The barrier semaphore is not a kernel input (pltpu.get_barrier_semaphore
    # makes it), so a Ref effect on it would name no jaxpr input.
    if pallas_core.semaphore_kind(avals[0]) is pallas_core.SemaphoreKind.BARRIER:
        return [], {compat.delay_effect}
    return [], {compat.WriteEffect(0)}


semaphore_signal_p.def_effectful_abstract_eval(_signal_abstract_eval)


#: ``pl.semaphore_wait``.
semaphore_wait_p = Primitive("semaphore_wait")
semaphore_wait_p.multiple_results = True


def semaphore_wait(sem_or_view: Any, value: int | jax.Array = 1, *, decrement: bool = True) -> None:
    """Blocks until the semaphore holds at least ``value``, then subtracts it.

    Args:
      sem_or_view: a REGULAR or BARRIER semaphore Ref (one semaphore).
      value: the amount to wait for.
      decrement: subtract ``value`` once it is there (False: only wait).
    """
    kinds = (pallas_core.SemaphoreKind.REGULAR, pallas_core.SemaphoreKind.BARRIER)
    sem, leaves, tree, _ = _check_semaphore(sem_or_view, "pl.semaphore_wait", kinds)
    value = _int_scalar(value, "pl.semaphore_wait value")
    semaphore_wait_p.bind(sem, *leaves, value, sem_tree=tree, decrement=bool(decrement))


semaphore_wait_p.def_effectful_abstract_eval(_signal_abstract_eval)


#: ``pl.semaphore_read``.
semaphore_read_p = Primitive("semaphore_read")


def semaphore_read(sem_or_view: Any) -> jax.Array:
    """The current value of a semaphore (any kind), an int32 scalar."""
    sem, leaves, tree, _ = _check_semaphore(
        sem_or_view, "pl.semaphore_read", tuple(pallas_core.SemaphoreKind)
    )
    return semaphore_read_p.bind(sem, *leaves, sem_tree=tree)


def _read_abstract_eval(*avals, **_):
    return compat.shaped_array((), jnp.int32), {compat.ReadEffect(0)}


semaphore_read_p.def_effectful_abstract_eval(_read_abstract_eval)


#: ``pl.delay``.
delay_p = Primitive("delay")
delay_p.multiple_results = True


def delay(nanos: int | jax.Array) -> None:
    """Sleeps for ``nanos`` nanoseconds (a no-op in interpret mode)."""
    delay_p.bind(_int_scalar(nanos, "pl.delay nanos"))


delay_p.def_effectful_abstract_eval(lambda *_: ([], {compat.delay_effect}))
# Interpret mode (the kernel's jaxpr run by XLA on the CPU): a wait computes nothing. The
# backends lower it for their chips themselves.
mlir.register_lowering(delay_p, lambda ctx, nanos: [])
batching.primitive_batchers[delay_p] = lambda args, dims: ([], [])


# ---------------------------------------------------------------------------
# pl.debug_check: a run-time assertion that interpreters check when debug
# checks are enabled (and that compiles to nothing otherwise).

#: ``pl.debug_check``.
debug_check_p = Primitive("debug_check")
debug_check_p.multiple_results = True
# A JAX config state (None: off): part of the jit cache key, as JAX's switch is.
_debug_checks = compat.config_state("pallas_ours_debug_checks", "pl.enable_debug_checks' switch.")


def debug_checks_enabled() -> bool:
    """Whether ``pl.debug_check`` binds its check (``pl.enable_debug_checks``)."""
    return bool(_debug_checks.value)


class enable_debug_checks(GlobalSwitch):  # noqa: N801  (JAX's name; a function and a context manager)
    """Turns ``pl.debug_check`` on (or off) from now on, or inside a ``with``
    block: ``with pl.enable_debug_checks(): ...``."""

    def __init__(self, enabled: bool = True):
        super().__init__(_debug_checks, enabled)


def debug_check(condition: Any, message: str) -> None:
    """Asserts ``condition`` (a bool scalar) when debug checks are enabled.

    Args:
      condition: the boolean that must hold.
      message: the error message; ``{0}``... are not substituted.
    """
    if not debug_checks_enabled():
        return
    if not isinstance(message, str):
        raise kernel_error(TypeError, f"pl.debug_check: message must be a str, got {message!r}")
    cond = jnp.asarray(condition)
    if cond.shape != () or cond.dtype != jnp.bool_:
        raise kernel_error(
            TypeError, f"pl.debug_check: condition must be a bool scalar, got {cond.dtype}{list(cond.shape)}"
        )
    message = message.replace("{", "{{").replace("}", "}}")
    k = errors.current_kernel()
    _check_sites[message] = (f"in kernel '{k[0]}' " if k else "") + f"at {errors.user_source()}: "
    debug_check_p.bind(cond, message=message)


debug_check_p.def_effectful_abstract_eval(lambda *_, **__: ([], {compat.delay_effect}))


def _debug_check_failed(ok, *, message, where):
    if not np.all(ok):
        # pallas_call raises the recorded error itself, not XLA's wrapper of it.
        raise record_runtime_error(AssertionError(f"{where}pl.debug_check failed: {message.format()}"))


# Where each message's check was written ('in kernel 'k' at file.py:12: '), noted as the kernel is
# traced: interpret mode's equations no longer carry the user's traceback when they are lowered.
# Keyed by the message: two checks with one message report the later one's place.
_check_sites: dict[str, str] = {}


def _debug_check_lowering(ctx, cond, *values, message):
    check = functools.partial(_debug_check_failed, message=message, where=_check_sites.get(message, ""))
    return mlir.lower_fun(lambda c, *v: jax.debug.callback(check, c) or [], multiple_results=True)(
        ctx, cond, *values
    )


# Interpret mode (the kernel's jaxpr run by XLA on the CPU) checks the condition on the host, as
# the TPU interpret mode does; a grid run as one batch checks every grid point's.
mlir.register_lowering(debug_check_p, _debug_check_lowering)


def _debug_check_batched(args, dims, *, message):
    cond, *rest = args
    if dims[0] is not batching.not_mapped:
        cond = jnp.all(cond)
    debug_check_p.bind(cond, *rest, message=message)
    return [], []


batching.primitive_batchers[debug_check_p] = _debug_check_batched
