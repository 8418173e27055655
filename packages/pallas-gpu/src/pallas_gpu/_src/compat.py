"""The one place pallas-gpu touches JAX internals (``jax._src``).

JAX has no public API for the state primitives (Ref loads/stores and their
indexers), the control-flow primitives' objects, or an equation's source
line. Everything the lowering needs from ``jax._src`` is imported here, so a
JAX release that moves them breaks this file only.
"""

from __future__ import annotations

import os
from typing import Any

from jax._src import ad_util as _ad_util
from jax._src import core as jax_core
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import debugging as _debugging
from jax._src import pjit as _pjit
from jax._src import pretty_printer as pp  # noqa: F401  (re-exported)
from jax._src import source_info_util
from jax._src.lax import control_flow as _control_flow
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types

from pallas import backend as plb

Literal = jax_core.Literal
Var = jax_core.Var
DropVar = jax_core.DropVar
Jaxpr = jax_core.Jaxpr
# JAX 0.11 folded ClosedJaxpr into Jaxpr (a Jaxpr carries its consts) and kept
# ClosedJaxpr as an alias; JAX 0.12 dropped the alias.
ClosedJaxpr = getattr(jax_core, "ClosedJaxpr", jax_core.Jaxpr)
AbstractRef = state_types.AbstractRef
NDIndexer = state_indexing.NDIndexer
Slice = state_indexing.Slice
TransformedRef = state_types.TransformedRef
ReadEffect = state_types.ReadEffect
WriteEffect = state_types.WriteEffect
transform_array = state_discharge.transform_array
transform_swap_array = state_discharge.transform_swap_array

get_p = state_primitives.get_p
swap_p = state_primitives.swap_p
addupdate_p = state_primitives.addupdate_p

cond_p = _control_flow.cond_p
while_p = _control_flow.while_p
scan_p = _control_flow.scan_p
cumsum_p = _control_flow.cumsum_p
cumprod_p = _control_flow.cumprod_p
cummax_p = _control_flow.cummax_p
cummin_p = _control_flow.cummin_p
jit_p = _pjit.jit_p
add_any_p = _ad_util.add_jaxvals_p  # sums tangents in JVPs
custom_jvp_call_p = _custom_derivatives.custom_jvp_call_p
custom_vjp_call_p = _custom_derivatives.custom_vjp_call_p
# The effect of debug_print and plgpu.debug_barrier: keeps them from being
# dead-code eliminated, and is allowed inside control flow.
debug_effect = _debugging.debug_effect


# Printing equations in jaxprs (``a[:, 1:] <- v``): the rule table of
# ``Jaxpr.pretty_print`` and its helpers; ``pp`` is JAX's document builder.
pp_eqn_rules = jax_core.pp_eqn_rules
pp_var = jax_core.pp_var
pp_vars = jax_core.pp_vars


# Equations bound inside pallas_gpu._src (plgpu.approx_tanh, ...) should name
# the line that called them, not ours; kernels of pallas_gpu.ops keep their lines.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))


def source_line(eqn: Any) -> str:
    """'file.py:42 (fn)' of the user code that produced ``eqn``."""
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is best effort
        return "<unknown>"


def is_ref_aval(aval: Any) -> bool:
    return isinstance(aval, AbstractRef)


def unwrap_jaxpr(j: Any) -> tuple[Any, tuple[Any, ...]]:
    """(jaxpr, consts) of a closed or open jaxpr."""
    if isinstance(j, ClosedJaxpr):
        return j.jaxpr, tuple(j.consts)
    return j, ()


def scan_counts(params: dict) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan_p equation (JAX 0.11 packs them in
    ``ft_in``; older JAX has ``num_consts``/``num_carry``)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def register_discharge_rule(prim: Any):
    """Registers ``rule(in_avals, out_avals, *args, **params)`` as the state
    discharge rule of ``prim`` (pallas-core adapts it to the installed JAX)."""

    def deco(rule):
        def adapted(ctx, *args, **params):
            return rule(ctx.in_avals, ctx.out_avals, *args, **params)

        plb.register_discharge_rule(prim)(adapted)
        return rule

    return deco


def reads_past_the_block_reach_the_array() -> bool:
    """Whether JAX's interpret mode reads a block Ref at a top-level dynamic
    integer index past the block's end from the array (jaxlib < 0.12, where XLA
    folds the two slices into one) or clamps it into the block (0.12+): the
    lowering gives the installed JAX's answer."""
    import jax

    return jax.__version_info__ < (0, 12)
