"""The one place pallas-tpu touches JAX internals (``jax._src``)."""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src.state import types as state_types

from pallas import backend as plb

DeviceIdType = plb.DeviceIdType
ReadEffect = state_types.ReadEffect
WriteEffect = state_types.WriteEffect
AbstractRef = state_types.AbstractRef
TransformedRef = state_types.TransformedRef
ReshapeTransform = state_types.ReshapeTransform  # ``ref.reshape(...)`` views
BitcastTransform = state_types.BitcastTransform  # ``ref.bitcast(dtype)`` views
ShapedArray = jax_core.ShapedArray
Literal = jax_core.Literal


def current_trace():
    """The trace ops are staged into now (a jaxpr under construction: one per
    ``lax.cond`` branch or loop body)."""
    return jax_core.trace_ctx.trace


def has_symbolic_shape(x) -> bool:
    """Whether ``x``'s shape has a symbolic dimension (``jax.export`` shape polymorphism)."""
    return any(jax_core.is_symbolic_dim(d) for d in getattr(x, "shape", ()))


def get_aval(x):
    return jax_core.typeof(x)


def ref_aval(shape, dtype, memory_space=None):
    return AbstractRef(ShapedArray(tuple(shape), dtype), memory_space)


def bound_axis_names() -> tuple[str, ...]:
    """The named axes bound where a kernel is traced (shard_map mesh axes)."""
    try:
        return tuple(n for n in jax_core.get_axis_env().axis_names() if isinstance(n, str))
    except Exception:
        return ()


def axis_sizes() -> dict:
    env = jax_core.get_axis_env()
    return {n: env.axis_size(n) for n in env.axis_names()}


# --- value primitives, random and tpu_info (vector_primitives.py, random.py, tpu_info.py)


def register_discharge_rule(prim):
    """Decorator: the state-discharge rule ``rule(ctx, *args, **params)`` of a
    primitive with Ref effects (pallas-core adapts it to the installed JAX)."""
    return plb.register_discharge_rule(prim)


def typeof(x):
    """The abstract value of ``x`` (a Ref's is an ``AbstractRef``)."""
    return jax_core.typeof(x)


def allow_effect_in_kernels(effect_type: type) -> None:
    """Let a non-Ref effect of a kernel primitive sit inside loops and conds
    and be lowered by ``jit``."""
    from jax._src import effects

    effects.control_flow_allowed_effects.add_type(effect_type)
    effects.lowerable_effects.add_type(effect_type)
    effects.custom_derivatives_allowed_effects.add_type(effect_type)
    effects.remat_allowed_effects.add_type(effect_type)


def abstract_device():
    """The abstract device of the current ``jax.sharding.use_abstract_mesh``
    (it names a TPU kind when compiling for a TPU elsewhere), or None."""
    from jax._src import mesh as mesh_lib

    return getattr(mesh_lib.get_abstract_mesh(), "abstract_device", None)


def default_device():
    """The device computations are placed on by default."""
    from jax._src.interpreters import pxla

    return pxla.get_default_device()


from jax._src.lax import control_flow as _cf  # noqa: E402
from jax._src.lax import parallel as _parallel  # noqa: E402
from jax._src.state import primitives as _state_prims  # noqa: E402
from jax._src.state.discharge import run_state_p  # noqa: E402,F401  (``pl.run_state`` inside kernels)

get_p = _state_prims.get_p
swap_p = _state_prims.swap_p
addupdate_p = _state_prims.addupdate_p
cond_p = _cf.cond_p
while_p = _cf.while_p
scan_p = _cf.scan_p
axis_index_p = _parallel.axis_index_p


def shaped_array(shape, dtype):
    return ShapedArray(tuple(shape), dtype)


def call_primitives():
    """(primitive, param holding its jaxpr) of call-like primitives the TPU
    interpreter inlines (jit, custom_jvp/vjp, remat, closed_call)."""
    from jax._src import ad_checkpoint, custom_derivatives, pjit
    from jax._src import core as jc

    out = [(pjit.jit_p, "jaxpr"), (jc.closed_call_p, "call_jaxpr"), (ad_checkpoint.remat_p, "jaxpr")]
    out.append((custom_derivatives.custom_jvp_call_p, "call_jaxpr"))
    out.append((custom_derivatives.custom_vjp_call_p, "call_jaxpr"))
    return out


def eqn_user_source(eqn) -> str | None:
    """'file.py:LINE' of the innermost frame of the user's code that made ``eqn``
    (frames of JAX, pallas and pallas_tpu are skipped)."""
    import os

    from jax._src import source_info_util

    tb = eqn.source_info.traceback
    if tb is None:
        return None
    for frame in source_info_util.user_frames(tb):
        if not plb.is_internal_file(frame.file_name):
            return f"{os.path.basename(frame.file_name)}:{frame.start_line}"
    return None


def eqn_location(eqn):
    """The MLIR location of ``eqn``: its primitive's name over the file, line and
    column of the innermost frame of the user's code (as JAX's lowerings give
    every op), so Mosaic's diagnostics name the user's line; unknown without one."""
    from jax._src import source_info_util
    from jaxlib.mlir import ir

    tb = eqn.source_info.traceback
    frame = None
    if tb is not None:
        frame = next(
            (f for f in source_info_util.user_frames(tb) if not plb.is_internal_file(f.file_name)), None
        )
    if frame is None:
        return ir.Location.name(eqn.primitive.name)
    file_loc = ir.Location.file(frame.file_name, frame.start_line, max(frame.start_column, 0) + 1)
    return ir.Location.name(eqn.primitive.name, childLoc=file_loc)


def forget_failed_effects() -> None:
    """Drops JAX's runtime tokens of ordered effects (the io_callbacks of TPU interpret
    mode): a kernel error stays attached to them, and ``jax.effects_barrier()`` would raise
    it again at every later call, since JAX clears them only after a clean wait."""
    from jax._src import dispatch

    try:
        dispatch.runtime_tokens.block_until_ready()
    except Exception:
        pass
    dispatch.runtime_tokens.clear()


def scan_split(params, ops):
    """(consts, carry init, xs) of a scan equation's operands on every JAX."""
    ops = list(ops)
    if "num_consts" in params:
        nc, nk = params["num_consts"], params["num_carry"]
        return ops[:nc], ops[nc : nc + nk], ops[nc + nk :]
    consts, carry, xs = params["ft_in"].update(ops).unpack()
    return list(consts), list(carry), list(xs)


_host_call_p = None


def host_callback(fn, result_shapes, *args):
    """``fn(*args)`` on the host, as ``io_callback(..., ordered=False)`` but
    handing ``fn`` the NumPy arrays XLA gives the callback: ``io_callback``
    first copies every argument into a ``jax.Array`` (a ``device_put`` each,
    most of the cost of the small callbacks of race detection). ``fn``
    returns a tuple of arrays matching ``result_shapes``."""
    global _host_call_p
    if _host_call_p is None:
        _host_call_p = _make_host_call_p()
    avals = tuple(jax_core.ShapedArray(s.shape, s.dtype) for s in result_shapes)
    return _host_call_p.bind(*args, callback=fn, result_avals=avals)


def _make_host_call_p():
    import functools

    import numpy as np
    from jax import lax
    from jax._src import callback as jax_callback
    from jax._src import dispatch
    from jax._src.interpreters import batching, mlir

    p = jax_core.Primitive("pallas_tpu_host_callback")
    p.multiple_results = True

    def run(callback, result_avals, *args):
        # XLA's buffers outlive the call only as copies (race detection keeps indices, DMAs data).
        outs = callback(*(np.array(a, copy=True) for a in args))
        return tuple(np.asarray(o, a.dtype).reshape(a.shape) for o, a in zip(outs, result_avals))

    def impl(*args, callback, result_avals):  # outside jit: the jitted primitive
        return dispatch.apply_primitive(p, *args, callback=callback, result_avals=result_avals)

    def abstract_eval(*avals, callback, result_avals):
        return result_avals, {jax_callback._IOEffect}

    def lowering(ctx, *args, callback, result_avals):
        sharding = jax_callback._callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        out, _, _ = jax_callback.emit_python_callback(
            ctx,
            functools.partial(run, callback, result_avals),
            None,
            list(args),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=False,
            sharding=sharding,
        )
        return out

    def batch(args, dims, callback, result_avals):  # one call per batch element, as io_callback
        args = [a if d is None else batching.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        batched = [i for i, d in enumerate(dims) if d is not None]

        def one(xs):
            full = list(args)
            for i, x in zip(batched, xs):
                full[i] = x
            return p.bind(*full, callback=callback, result_avals=result_avals)

        outs = lax.map(one, [args[i] for i in batched])
        return outs, (0,) * len(outs)

    p.def_impl(impl)
    p.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(p, lowering, cacheable=False)
    batching.primitive_batchers[p] = batch
    return p


# --- the Mosaic lowering (lowering*.py, pallas_call_registration.py)


def indexing_types():
    """(NDIndexer, Slice): the indexing transforms of Ref reads and writes."""
    from jax._src import indexing
    from jax._src.state import indexing as state_indexing

    return state_indexing.NDIndexer, indexing.Slice


def is_drop_var(v) -> bool:
    """Whether a jaxpr outvar is ``_`` (its value is never used)."""
    return isinstance(v, jax_core.DropVar)


def lower_mosaic_to_custom_call(ctx, *in_nodes, module, out_avals, kernel_name, **config):
    """The ``tpu_custom_call`` of a Mosaic module (JAX's own serialization
    and backend config); ``config`` holds the keyword arguments of JAX's
    ``lower_module_to_custom_call`` (vmem_limit_bytes, flags, ...)."""
    from jax._src import tpu_custom_call

    side = config.pop("has_side_effects", False)
    if not isinstance(side, bool):
        side = tpu_custom_call.TpuSideEffectType[side.name]
    config = _supported_custom_call_config(tpu_custom_call.lower_module_to_custom_call, kernel_name, config)
    return tpu_custom_call.lower_module_to_custom_call(
        ctx,
        *in_nodes,
        module=module,
        out_type=out_avals,
        kernel_name=kernel_name,
        has_side_effects=side,
        **config,
    )


def _supported_custom_call_config(fn, kernel_name, config: dict) -> dict:
    """``config`` without the keywords the installed JAX's ``lower_module_to_custom_call``
    lacks (JAX 0.10 has no ``opt_level`` or ``collective_id_tag``) when they hold their
    defaults; a set one is refused, naming the kernel and the JAX that has it."""
    import inspect

    import jax

    accepted = inspect.signature(fn).parameters
    out = {}
    for key, value in config.items():
        if key in accepted:
            out[key] = value
        elif value not in (None, False, 0, (), {}):
            raise NotImplementedError(
                f"pallas_tpu: kernel {kernel_name!r} sets {key}={value!r}, which the installed "
                f"JAX {jax.__version__} cannot pass to the TPU custom call: it needs JAX >= 0.11.2"
            )
    return out


def lowering_tpu_device(ctx):
    """The first TPU device a lowering compiles for (jit's device assignment, the mesh
    of a ``jax.shard_map``, or a device of the TPU client it compiles with: a compile-only
    topology's), or None (an export without a TPU client, or a CPU)."""
    import numpy as np

    ac = ctx.module_context.axis_context
    devices = getattr(ac, "device_assignment", None)
    if devices is None:
        try:
            devices = list(np.ravel(ac.mesh.devices))
        except (AttributeError, TypeError, ValueError):
            devices = ()
    found = next((d for d in devices if getattr(d, "platform", None) == "tpu"), None)
    if found is None:  # jit lowers without a device assignment: the client it compiles with
        backend = getattr(ctx.module_context, "backend", None)
        if getattr(backend, "platform", None) == "tpu":
            found = next(iter(backend.devices()), None)
    return found


def mesh_axes(ctx) -> tuple[tuple[str, int], ...]:
    """((name, size), ...) of the device mesh a lowering runs in (inside
    ``jax.shard_map``), or () outside one."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None:
        return ()
    return tuple((n, int(mesh.shape[n])) for n in mesh.axis_names)


def identity_primitives():
    """Primitives that are the identity inside a kernel: ``pvary`` (the
    varying-axes annotation of values in ``jax.shard_map``)."""
    return [p for p in (getattr(jax_core, "pvary_p", None),) if p is not None]


def emits_wait_dma() -> bool:
    """Whether this JAX's Mosaic lowering waits for DMAs with ``tpu.wait_dma``
    (both semaphores and ``wait_target``; JAX 0.12+) rather than ``tpu.wait_dma2``."""
    import jax

    return jax.__version_info__ >= (0, 12)


def races_raise_by_default() -> bool:
    """Whether this JAX's TPU interpret mode raises on a data race by default
    (``InterpretParams(on_race="raise")``, JAX 0.12+) rather than printing it and
    setting ``races.races_found`` (JAX 0.11 and older, which have no ``on_race``)."""
    import jax

    return jax.__version_info__ >= (0, 12)


def sharding_identity_primitives():
    """``reshard`` (a sharding annotation, the identity inside a kernel)."""
    from jax._src import pjit

    return [p for p in (getattr(pjit, "reshard_p", None),) if p is not None]


# --- PRNG keys in kernels (lowering_random.py)


def random_primitives() -> dict:
    """JAX's PRNG primitives by name: ``random_seed``, ``random_bits``,
    ``random_split``, ``random_fold_in``, ``random_wrap``, ``random_unwrap``,
    ``threefry2x32`` and ``iota_2x32_shape``."""
    from jax._src.random import prng, threefry2x32

    prims = [
        prng.random_seed_p,
        prng.random_bits_p,
        prng.random_split_p,
        prng.random_fold_in_p,
        prng.random_wrap_p,
        prng.random_unwrap_p,
        prng.iota_2x32_shape_p,
        threefry2x32.threefry2x32_p,
    ]
    return {p.name: p for p in prims}


def physical_aval(aval):
    """A key array's aval as its key data (``key<fry>[n]`` -> ``uint32[n, 2]``);
    any other aval unchanged."""
    return jax_core.physical_aval(aval)


def prng_spec_impl(spec):
    """The PRNG implementation behind a ``jax.extend.random`` spec (what
    ``define_prng_impl`` returns; ``key_impl`` of its keys' dtype)."""
    return getattr(spec, "_impl", spec)


def key_impl(dtype):
    """The PRNG implementation of a key dtype (its ``seed``, ``split``,
    ``fold_in``, ``random_bits`` act on key data)."""
    return dtype._impl


def zero_tangent(primal):
    """The symbolic zero tangent of ``primal`` (``ad.Zero`` of its tangent aval); JAX's
    ``ad.Zero.from_primal_value`` is gone from the JAX versions we support."""
    from jax._src import ad_util

    return ad_util.p2tz(primal)
