"""The one place pallas-core touches JAX internals (``jax._src``).

JAX has no public API for Refs inside traced functions, state discharge, or
tracing a function over abstract Refs. Everything pallas-core needs from
``jax._src`` is imported here and nowhere else, so a JAX release that moves
these breaks this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax._src import config as _config
from jax._src import core as jax_core
from jax._src import linear_util as lu
from jax._src import source_info_util, tree_util
from jax._src import xla_bridge as _xla_bridge
from jax._src.api_util import debug_info as _debug_info
from jax._src.debugging import debug_effect  # noqa: E402
from jax._src.indexing import Slice  # noqa: F401
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing  # noqa: F401
from jax._src.state import primitives as state_primitives  # noqa: F401
from jax._src.state import types as state_types

primitive_linearizations = _ad.primitive_linearizations
# An effect that keeps an otherwise result-less primitive (pl.delay) alive.
delay_effect = debug_effect
AbstractRef = state_types.AbstractRef
TransformedRef = state_types.TransformedRef
RefEffect = state_types.RefEffect
ReadEffect = state_types.ReadEffect
WriteEffect = state_types.WriteEffect
AccumEffect = state_types.AccumEffect
ShapedArray = jax_core.ShapedArray
Jaxpr = jax_core.Jaxpr
# JAX 0.11 folded ClosedJaxpr into Jaxpr (keeping an alias); 0.12 dropped the alias.
ClosedJaxpr = getattr(jax_core, "ClosedJaxpr", jax_core.Jaxpr)
_HAS_CLOSED_JAXPR = hasattr(jax_core, "ClosedJaxpr")
# JAX < 0.11: a ClosedJaxpr wraps a Jaxpr and its consts (0.11's alias is Jaxpr itself).
CLOSED_JAXPR_WRAPS = ClosedJaxpr is not jax_core.Jaxpr


def close_jaxpr(jaxpr):
    """A jaxpr with no constvars, as a closed jaxpr on every supported JAX."""
    if _HAS_CLOSED_JAXPR and not getattr(jaxpr, "consts", None) and jaxpr.constvars == []:
        return ClosedJaxpr(jaxpr, ())
    return jaxpr


Literal = jax_core.Literal
Var = jax_core.Var
_HAS_DISCHARGE_CONTEXT = hasattr(state_discharge, "DischargeContext")


@dataclasses.dataclass(frozen=True)
class _DischargeContext:
    """JAX 0.11's ``DischargeContext``, built for the rules on older JAX."""

    in_avals: Sequence[Any]
    out_avals: Sequence[Any]
    should_discharge: Sequence[bool]
    strip_memory_space: bool = False


def register_discharge_rule(prim):
    """Decorator: ``rule(ctx, *args, **params)`` is the state discharge rule of
    ``prim`` on every supported JAX. ``ctx`` has ``in_avals``, ``out_avals`` and
    ``should_discharge`` (JAX 0.11's ``DischargeContext``); JAX 0.10 calls a
    partial discharge rule as ``rule(should_discharge, in_avals, out_avals, ...)``."""

    def deco(rule):
        if _HAS_DISCHARGE_CONTEXT:
            state_discharge.register_discharge_rule(prim)(rule)
        else:

            def partial_rule(should_discharge, in_avals, out_avals, *args, **params):
                ctx = _DischargeContext(tuple(in_avals), tuple(out_avals), tuple(should_discharge))
                return rule(ctx, *args, **params)

            state_discharge.register_partial_discharge_rule(prim)(partial_rule)
        return rule

    return deco


# ``run_state(f)(init)``: runs ``f`` over Refs holding ``init`` and returns their final
# values. JAX's state primitive (not part of its Pallas); every JAX rule for it
# (discharge, AD, vmap, lowering) comes with it, so it works inside kernels too.
run_state = state_discharge.run_state


def lax_primitive(name: str):
    """``jax.lax``'s primitive ``name``, or None where the installed JAX lacks it
    (JAX 0.10 has no ``log2_p`` or ``one_minus_square_p``: log2 and the tanh
    derivative trace to other primitives there). Rule tables skip None."""
    import jax

    return getattr(jax.lax, name, None)


def register_neutral_memory_space(memory_space) -> None:
    """Tells state discharge that values in ``memory_space`` need no memory-space
    constraint. JAX < 0.11's discharge ignores memory spaces: nothing to register."""
    register = getattr(state_discharge, "register_neutral_memory_space", None)
    if register is not None:
        register(memory_space)


no_effects = jax_core.no_effects


def eval_jaxpr(jaxpr, consts, *args):
    """``jax.core.eval_jaxpr``; on JAX < 0.11 with every ``closed_call`` inlined
    (``_inline_calls``)."""
    if CLOSED_JAXPR_WRAPS and _has_closed_call(jaxpr):
        return _eval_inlining(jaxpr, consts, args)
    return jax_core.eval_jaxpr(jaxpr, consts, *args)


def jaxpr_as_fun(closed):
    """``jax.core.jaxpr_as_fun``; on JAX < 0.11 with every ``closed_call`` inlined."""
    if CLOSED_JAXPR_WRAPS and _has_closed_call(closed):
        return lambda *args: _eval_inlining(closed.jaxpr, closed.consts, args)
    return jax_core.jaxpr_as_fun(closed)


# JAX 0.10's vmap of a ``closed_call`` (which its scan partial eval emits for a
# fori_loop's loop-invariant part) adds a ``name`` parameter that its own jaxpr
# checker then refuses (``_check_closed_call() got an unexpected keyword argument
# 'name'`` under jax_enable_checks). Interpret mode vmaps kernel bodies, so on
# that JAX the bodies it evaluates have their closed_calls inlined, at every depth.


def _has_closed_call(jaxpr) -> bool:
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in inner.eqns:
        if eqn.primitive is jax_core.closed_call_p:
            return True
        for v in eqn.params.values():
            subs = v if isinstance(v, (tuple, list)) else (v,)
            if any(_is_jaxpr(x) and _has_closed_call(x) for x in subs):
                return True
    return False


def _inline_calls(closed):
    """A closed jaxpr computing what ``closed`` does, with no ``closed_call``."""
    if not _has_closed_call(closed):
        return closed
    fun = lu.wrap_init(
        lambda *args: _eval_inlining(closed.jaxpr, closed.consts, args), debug_info=closed.jaxpr.debug_info
    )
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, closed.in_avals)
    return ClosedJaxpr(jaxpr, consts)


def _inline_param(v):
    if isinstance(v, ClosedJaxpr):
        return _inline_calls(v)
    if isinstance(v, tuple) and any(isinstance(x, ClosedJaxpr) for x in v):
        return tuple(_inline_param(x) for x in v)
    return v


def _eval_inlining(jaxpr, consts, args):
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is jax_core.closed_call_p:
            call = eqn.params["call_jaxpr"]
            outs = _eval_inlining(call.jaxpr, call.consts, ins)
        else:
            params = {k: _inline_param(v) for k, v in eqn.params.items()}
            bind_params = eqn.primitive.get_bind_params(params)  # JAX 0.10: the params, subfuns inside
            with source_info_util.user_context(
                eqn.source_info.traceback, name_stack=eqn.source_info.name_stack
            ):
                outs = eqn.primitive.bind(*ins, **bind_params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jax_core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def is_symbolic_dim(d) -> bool:
    """Whether ``d`` is a symbolic dimension (``jax.export`` shape polymorphism)."""
    return jax_core.is_symbolic_dim(d)


def dimension_as_value(d):
    """The traced int value of a symbolic dimension (an int stays an int)."""
    return jax_core.dimension_as_value(d)


def eval_context():
    """Evaluates eagerly even inside a trace (for static index-map tables)."""
    return jax_core.eval_context()


def extend_axis_env(names_and_sizes):
    """Binds named axes (a named pallas_call grid) so lax.axis_index traces."""
    return jax_core.extend_axis_env_nd(list(names_and_sizes))


def current_source_info():
    return source_info_util.current()


def eqn_user_source(eqn) -> str | None:
    """'file.py:LINE' of the user code that created a jaxpr equation."""
    import os

    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}"


def ref_indexers(eqn):
    """(ref shape, NDIndexer) for each indexing transform of a Ref get/swap/addupdate."""
    prim = eqn.primitive
    if prim is state_primitives.get_p:
        flat = eqn.invars[1:]
    elif prim in (state_primitives.swap_p, state_primitives.addupdate_p):
        flat = eqn.invars[2:]
    else:
        return []
    vals = [v.val if isinstance(v, Literal) else v for v in flat]
    transforms = tree_util.tree_unflatten(eqn.params["tree"], vals)
    return [t for t in transforms if isinstance(t, state_indexing.NDIndexer)]


def ref_index_literals(eqn) -> list[tuple[tuple[int, ...], int, int, Any]]:
    """(ref shape, dim, position in eqn.invars, value) of every static integer
    index (a Literal) of a Ref get/swap/addupdate."""
    prim = eqn.primitive
    first = {state_primitives.get_p: 1, state_primitives.swap_p: 2, state_primitives.addupdate_p: 2}.get(prim)
    if first is None:
        return []
    flat = eqn.invars[first:]
    marked = tree_util.tree_unflatten(eqn.params["tree"], list(range(len(flat))))
    out = []
    for t in marked:
        if not isinstance(t, state_indexing.NDIndexer):
            continue
        for dim, pos in enumerate(t.indices):
            if isinstance(pos, int) and dim < len(t.shape) and isinstance(flat[pos], Literal):
                out.append((tuple(t.shape), dim, first + pos, flat[pos].val))
    return out


def replace_literal(eqn, position: int, value):
    """``eqn`` with its Literal input at ``position`` replaced by ``value``."""
    old = eqn.invars[position]
    invars = list(eqn.invars)
    invars[position] = Literal(type(old.val)(value) if not isinstance(old.val, int) else value, old.aval)
    return eqn.replace(invars=invars)


def subjaxprs(jaxpr):
    from jax.extend.core import subjaxprs as _sub

    return list(_sub(jaxpr))


def make_debug_info(traced_for: str, fun: Callable, args: Sequence[Any]):
    # One placeholder leaf per flat argument: jax_enable_checks wants one name per input.
    return _debug_info(traced_for, fun, tuple(range(len(args))), {})


def pytree_mismatch_message(what1: str, tree1, what2: str, tree2) -> str:
    """JAX's Pallas wording for two pytree structures that differ (``Pytree for
    `in_specs` and `inputs` do not match. There are 1 mismatches, including: ...``),
    from JAX's own description of the differences (not exported)."""
    errs = list(tree_util.equality_errors_pytreedef(tree1, tree2))
    lines = [f"Pytree for {what1} and {what2} do not match. There are {len(errs)} mismatches, including:"]
    for path, thing1, thing2, explanation in errs:
        where = f"at {tree_util.keystr(path)}, " if path else ""
        lines.append(f"    * {where}{what1} is a {thing1} but {what2} is a {thing2}, so {explanation}")
    return "\n".join(lines)


def _no_mutable_array_checks():
    checks = getattr(_config, "mutable_array_checks", None)
    return checks(False) if checks is not None else contextlib.nullcontext()


def trace_to_closed_jaxpr(fun: Callable, in_avals: Sequence[Any], debug_info) -> tuple[Any, list[Any]]:
    """Traces ``fun`` (flat args -> flat list of outputs) to a closed jaxpr.

    Returns the closed jaxpr (no constvars) and the constant values it
    captured, which become leading invars of the returned jaxpr.
    """
    wrapped = lu.wrap_init(fun, debug_info=debug_info)
    # Kernels may carry Refs through loops and return them from cond branches, as under JAX's
    # Pallas, which traces its kernels with JAX's mutable-array checks off (on under
    # jax_enable_checks, they refuse a Ref in a fori_loop carry).
    with _no_mutable_array_checks():
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, in_avals)
    if consts or jaxpr.constvars:
        jaxpr = pe.convert_constvars_jaxpr(jaxpr)
    return close_jaxpr(jaxpr), list(consts)


def has_discharge_rule(prim) -> bool:
    """Whether state discharge (pallas-core's interpret mode) has a rule for ``prim``."""
    return prim in getattr(state_discharge, "_discharge_rules", {}) or prim in getattr(
        state_discharge, "_partial_discharge_rules", {}
    )


def discharge(closed_jaxpr, should_discharge: bool | Sequence[bool] = True):
    """Closed jaxpr over Refs -> closed pure jaxpr returning final Ref values."""
    jaxpr = state_discharge.discharge_state(closed_jaxpr, should_discharge=should_discharge)
    if getattr(jaxpr, "consts", None) is None:
        jaxpr = close_jaxpr(jaxpr)
    return jaxpr


def jvp_jaxpr(closed_jaxpr, nonzeros: Sequence[bool], instantiate):
    return _ad.jvp_jaxpr(closed_jaxpr, nonzeros, instantiate)


def is_ref_aval(aval) -> bool:
    return isinstance(aval, AbstractRef)


def ref_aval(shape, dtype, memory_space=None) -> AbstractRef:
    return AbstractRef(ShapedArray(tuple(shape), dtype), memory_space)


def shaped_array(shape, dtype) -> ShapedArray:
    return ShapedArray(tuple(shape), dtype)


def get_aval(x):
    return jax_core.typeof(x)


def effect_input_index(effect, jaxpr) -> int:
    """Position among ``jaxpr.invars`` of the input a Ref effect is about."""
    if hasattr(effect, "input_index"):  # older JAX: an int position
        return effect.input_index
    inp = effect.input  # JAX 0.11+: a Var inside jaxprs, an int in abstract eval
    if isinstance(inp, int):
        return inp
    return list(jaxpr.invars).index(inp)


def ref_effect_at(effect, index: int):
    """The same kind of Ref effect, about input position ``index``."""
    if hasattr(effect, "input_index"):
        return type(effect)(index)
    return effect.replace(index)


def jaxpr_effects_on_inputs(closed_jaxpr) -> set[tuple[type, int]]:
    """(effect class, input index) for every Ref effect of a jaxpr."""
    return {
        (type(e), effect_input_index(e, closed_jaxpr))
        for e in closed_jaxpr.effects
        if isinstance(e, RefEffect)
    }


def _is_jaxpr(x) -> bool:
    return hasattr(x, "eqns") or (hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"))


def map_eqns(jaxpr, fn, drop_effects=frozenset()):
    """A copy of ``jaxpr`` (and of every jaxpr in its equations' params) with
    each equation replaced by ``fn(eqn)`` and ``drop_effects`` removed."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    if CLOSED_JAXPR_WRAPS and isinstance(jaxpr, ClosedJaxpr):  # a ClosedJaxpr wrapper (JAX < 0.11)
        mapped = map_eqns(inner, fn, drop_effects)
        return jaxpr if mapped is inner else jaxpr.replace(jaxpr=mapped)

    def param(v):
        if _is_jaxpr(v):
            return map_eqns(v, fn, drop_effects)
        if isinstance(v, (tuple, list)) and any(_is_jaxpr(x) for x in v):
            return type(v)(param(x) for x in v)
        return v

    eqns = []
    changed = bool(drop_effects & set(jaxpr.effects))
    for old in jaxpr.eqns:
        params = {k: param(v) for k, v in old.params.items()}
        e = old
        if any(params[k] is not old.params[k] for k in params):
            e = e.replace(params=params)
        e = fn(e)
        if drop_effects & set(e.effects):
            e = e.replace(effects=frozenset(e.effects) - drop_effects)
        changed = changed or e is not old
        eqns.append(e)
    if not changed:  # nothing to replace: the jaxpr itself (rebuilding one walks every equation)
        return jaxpr
    return jaxpr.replace(eqns=eqns, effects=frozenset(jaxpr.effects) - drop_effects)


def named_axis_effects(names):
    return frozenset(jax_core.NamedAxisEffect(n) for n in names)


def axis_index_primitive():
    from jax._src.lax import parallel

    return parallel.axis_index_p


# ``pl.broadcast_to``: JAX's state primitive, so kernels written for either
# package trace to the same primitive and every backend lowers one rule.
broadcast_to = state_primitives.broadcast_to
#: JAX's ``pl.broadcast_to`` state primitive (backends lower it).
broadcast_to_p = state_primitives.broadcast_to_p


# --- Lowering for several platforms at once (jax.export(..., platforms=[...]))


def lowering_platforms(ctx) -> tuple[str, ...]:
    """The platforms a lowering rule emits code for: one, or several when
    ``jax.export`` lowers for many (inside a branch of another multi-platform
    rule, only that branch's)."""
    return tuple(_mlir._platforms_for_eqn(ctx))


def lower_per_platform(ctx, description: str, rules: dict, *args, **kwargs):
    """Emits ``rules[p](ctx, *args, **kwargs)`` for each lowering platform ``p``,
    behind a switch on the platform index when there are several (JAX's
    ``mlir.lower_per_platform``, the same in 0.11 and 0.12; not public)."""
    return _mlir.lower_per_platform(ctx, description, rules, None, no_effects, *args, **kwargs)


def lowering_for_export(ctx) -> bool:
    """Whether the module being lowered is for ``jax.export`` (serialized)."""
    return bool(ctx.module_context.lowering_parameters.for_export)


def host_callback_count(ctx) -> int:
    """How many host callbacks the module lowered so far calls (``jax.export``
    refuses modules with any)."""
    return len(ctx.module_context.host_callbacks)


def host_callbacks_unavailable(ctx) -> bool:
    """Whether JAX refuses to lower a host callback here: the module's backend
    is for another platform than the one being lowered (``jax.export`` for
    'cpu' on a machine whose default backend is a GPU)."""
    backend = ctx.module_context.backend
    platforms = lowering_platforms(ctx)
    if backend is None:
        return False
    return len(platforms) > 1 or _xla_bridge.canonicalize_platform(backend.platform) != platforms[0]


def reads_past_the_block_reach_the_array() -> bool:
    """Whether JAX's interpret mode reads a block Ref at a dynamic integer index
    past the block's end from the array (jaxlib < 0.12: XLA folds the block's
    ``dynamic_slice`` and the read's into one slice of the array, clamped to the
    array) rather than clamping the index into the block (jaxlib 0.12+, which is
    ``dynamic_slice``'s own semantics). Our interpreters and pallas-gpu follow
    the installed JAX, so that every mode gives JAX's answer."""
    import jax

    return jax.__version_info__ < (0, 12)


def config_state(name: str, help: str):  # noqa: A002  (JAX's parameter name)
    """A JAX config state holding any object (default None) that is part of the jit cache key
    and the trace context, settable thread-locally (``with state(value)``) and globally
    (``state.set_global(value)``); ``state.value`` reads it. The name must be new to JAX.
    A bare ``State``, as JAX's own ``pallas_tpu_interpret_mode_context_manager`` is, not a
    flag: ``jax.config.parse_flags_with_absl()`` defines an absl string flag of every
    ``string_or_object_state``, and refuses one set to an object (tokamax's tests call it)."""
    return _config.State(name, None, help, include_in_jit_key=True, include_in_trace_context=True)


def zero_tangent(primal):
    """The symbolic zero tangent of ``primal`` (``ad.Zero`` of its tangent aval: float0 for
    integers). JAX's ``ad.Zero.from_primal_value`` is gone from the JAX versions we support."""
    from jax._src import ad_util

    return ad_util.p2tz(primal)
