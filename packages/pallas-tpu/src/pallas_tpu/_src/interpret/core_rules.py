"""The TPU interpreter's rules for the primitives of JAX and pallas-core that a
kernel binds on Refs or with control flow around Refs: reads and writes,
``cond``/``while``/``scan`` (the cells and hidden state carried through them),
calls, ``pl.run_scoped`` and ``pl.run_state`` (fresh cells), semaphores and
``pl.debug_check``. They register in ``rules.STATE_RULES`` as the backend's own
primitives do (``dma.py``, ``language/``); ``pallas_call.py`` imports this module."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax, tree_util

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import mxu as interpret_mxu
from pallas_tpu._src.interpret import rules, shared_scopes
from pallas_tpu._src.interpret.cursor import Hidden
from pallas_tpu._src.interpret.interpreter import CALL_PARAMS, drain, is_static_scalar
from pallas_tpu._src.interpret.refs import RefView
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import mxu as tpu_mxu
from pallas_tpu._src.language import primitives as tpu_prims


def rule(*prims):
    def register(fn):
        for p in prims:
            rules.STATE_RULES[p] = fn
        return fn

    return register


def _ref_and_transforms(interp, ref, leaves, tree):
    ts = plb.unflatten_transforms(tree, leaves)
    return ref.with_transforms(ts)


@rule(compat.get_p)
def _get(interp, eqn, ref, *leaves):
    interpret_mxu.refuse_direct_access(interp, ref, eqn)
    return interp.read_view(_ref_and_transforms(interp, ref, leaves, eqn.params["tree"]), eqn)


@rule(compat.swap_p)
def _swap(interp, eqn, ref, val, *leaves):
    interpret_mxu.refuse_direct_access(interp, ref, eqn)
    view = _ref_and_transforms(interp, ref, leaves, eqn.params["tree"])
    old = interp.read_view(view, eqn, what="write")
    interp.write_view(view, val, eqn)
    return old


@rule(compat.addupdate_p)
def _addupdate(interp, eqn, ref, val, *leaves):
    view = _ref_and_transforms(interp, ref, leaves, eqn.params["tree"])
    interp.write_view(view, interp.read_view(view, eqn, what="write") + val, eqn)
    return []


@rule(plb.debug_check_p)
def _debug_check(interp, eqn, cond, *values):
    interp.check(
        jnp.asarray(cond), f"{interp.where(eqn)}: pl.debug_check failed: {eqn.params['message']}", values
    )
    return []


@rule(plb.multiple_of_p)
def _multiple_of(interp, eqn, x):
    return x


@rule(plb.delay_p)
def _delay(interp, eqn, nanos):
    return []


@rule(tpu_prims.request_p_state_p)
def _request_p_state(interp, eqn):
    return []  # a clock frequency: how fast the kernel runs, not what it computes


@rule(plb.grid_axis_index_p)
def _grid_axis_index(interp, eqn):
    return interp.grid_env[eqn.params["axis_name"]]


@rule(plb.dynamic_grid_size_p)
def _dynamic_grid_size(interp, eqn):
    """``pl.num_programs`` of a grid axis of traced size, in an index map."""
    return jnp.asarray(interp.grid_sizes[eqn.params["axis"]], jnp.int32)


def _state_items(interp):
    """The cells' keys, their values and the hidden state: the carry of a loop
    or cond that the kernel's Refs and hidden state go through."""
    interp.flush_checks()
    keys = sorted(interp.state)
    return keys, [interp.state[k] for k in keys], interp.hidden


def _set_state(interp, keys, vals, hidden: Hidden):
    interp.state = dict(zip(keys, vals))
    interp.hidden = hidden


def _static_branch(eqn, index):
    """The branch a cond takes when its index is known while tracing (else None)."""
    if not is_static_scalar(index):
        return None
    branches = eqn.params["branches"]
    return branches[min(max(int(index), 0), len(branches) - 1)]  # clamped, as lax.switch


def _iter_cond(interp, eqn, invals, pause):
    """A cond of cores in lockstep: a static index runs its branch in line, where a core
    may pause at a semaphore wait (``pl.when(lax.axis_index("x") == 1)``)."""
    branch = _static_branch(eqn, invals[0])
    if branch is None:
        return _cond(interp, eqn, *invals)
    return (yield from interp.iter_jaxpr(branch.jaxpr, branch.consts, invals[1:], pause))


@rule(compat.cond_p)
def _cond(interp, eqn, index, *ops):
    branches = eqn.params["branches"]
    static = _static_branch(eqn, index)
    if static is not None:
        return interp.eval_closed(static, list(ops))
    keys, vals, hidden = _state_items(interp)
    ref_pos = {i for i, x in enumerate(ops) if isinstance(x, RefView)}
    plain = [x for i, x in enumerate(ops) if i not in ref_pos]

    def make(branch):
        def f(vals, hidden, plain):
            _set_state(interp, keys, vals, hidden)
            it = iter(plain)
            args = [ops[i] if i in ref_pos else next(it) for i in range(len(ops))]
            outs = interp.eval_closed(branch, args)
            _, nv, nh = _state_items(interp)
            return nv, nh, outs

        return f

    nv, nh, outs = lax.switch(index, [make(b) for b in branches], vals, hidden, plain)
    _set_state(interp, keys, nv, nh)
    return outs


@rule(compat.while_p)
def _while(interp, eqn, *ops):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ops[:nc], ops[nc : nc + nb], ops[nc + nb :]
    keys, vals, hidden = _state_items(interp)

    def cond_fun(carry):
        vals, hidden, c = carry
        _set_state(interp, keys, vals, hidden)
        (pred,) = interp.eval_closed(p["cond_jaxpr"], [*cconsts, *c])
        interp.drop_checks()  # a loop condition returns its predicate only: its checks are not kept
        return pred

    def body_fun(carry):
        vals, hidden, c = carry
        _set_state(interp, keys, vals, hidden)
        out = interp.eval_closed(p["body_jaxpr"], [*bconsts, *c])
        _, nv, nh = _state_items(interp)
        return nv, nh, list(out)

    nv, nh, out = lax.while_loop(cond_fun, body_fun, (vals, hidden, list(init)))
    _set_state(interp, keys, nv, nh)
    return out


@rule(compat.scan_p)
def _scan(interp, eqn, *ops):
    p = eqn.params
    consts, init, xs = compat.scan_split(p, ops)
    n_carry = len(init)
    keys, vals, hidden = _state_items(interp)

    def body(carry, x):
        vals, hidden, c = carry
        _set_state(interp, keys, vals, hidden)
        out = interp.eval_closed(p["jaxpr"], [*consts, *c, *x])
        _, nv, nh = _state_items(interp)
        return (nv, nh, list(out[:n_carry])), list(out[n_carry:])

    (nv, nh, carry), ys = lax.scan(
        body,
        (vals, hidden, list(init)),
        list(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p.get("unroll", 1),
    )
    _set_state(interp, keys, nv, nh)
    return [*carry, *ys]


def _inline(param):
    def r(interp, eqn, *ops):
        sub = eqn.params[param]
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
            return interp.eval_closed(sub, ops)
        return interp.eval_jaxpr(sub, (), ops)

    return r


for _p, _param in CALL_PARAMS.items():
    rules.STATE_RULES[_p] = _inline(_param)


@rule(plb.run_scoped_p)
def _run_scoped(interp, eqn, *consts):
    return drain(_iter_run_scoped(interp, eqn, consts, None))


def _iter_run_scoped(interp, eqn, consts, pause):
    jaxpr = eqn.params["jaxpr"]
    n = eqn.params["num_consts"]
    targets = interp.dma_targets(jaxpr)
    scopes = interp.scopes
    # Cores in lockstep (shared_scopes.py): the k-th scope of each core is one scope; its
    # HBM buffers are shared (outside traced control flow: ``pause`` is given there).
    ordinal = scopes.enter(interp.core_id) if scopes.lanes > 1 else None
    cells, shared = [], []
    for i, aval in enumerate(jaxpr.in_avals[n:]):
        space = getattr(aval, "memory_space", None)
        if space is tpu_core.HBM and not interp.params.allow_hbm_allocation_in_run_scoped:
            raise ValueError(
                f"{interp.where(eqn)}: pl.run_scoped allocates HBM, which a TPU kernel cannot "
                "(JAX: Cannot allocate HBM in `run_scoped`.); pass "
                "allow_hbm_allocation_in_run_scoped=True to InterpretParams to allow it in interpret mode"
            )
        if plb.semaphore_kind(aval) is not None:
            init = jnp.zeros(aval.shape, jnp.int32)
        elif tpu_mxu.is_acc(aval):  # an MXU's accumulators: empty when a scope takes them
            init = jnp.zeros(aval.shape, aval.dtype)
        elif plb.poison_buffers_enabled():  # pl.enable_poison_buffers
            init = jnp.full(aval.shape, plb.poison_value(aval.dtype), aval.dtype)
        else:
            init = interp.memory.fresh(aval.shape, aval.dtype)
        name = f"pl.run_scoped buffer {i} ({aval.dtype}{list(aval.shape)})"

        def make(init=init, name=name, space=space, i=i):
            return interp.new_cell(init, name, space, dma_target=n + i in targets)

        if ordinal is not None and pause is not None and shared_scopes.is_shared_space(space):
            cells.append(scopes.shared_cell((ordinal, i), interp.core_id, make))
            shared.append((ordinal, i))
        else:
            cells.append(make())
            shared.append(None)
        if ordinal is not None:
            scopes.labels[cells[-1]] = (ordinal, i)
    views = [RefView(c) for c in cells]
    outs = yield from interp.iter_jaxpr(jaxpr.jaxpr, jaxpr.consts, [*consts, *views], pause)
    for aval, v in zip(jaxpr.in_avals[n:], views):
        if plb.semaphore_kind(aval) is not None:
            check_sem_zero(interp, v, eqn, "at the end of pl.run_scoped")
        elif tpu_mxu.is_acc(aval):
            interpret_mxu.check_acc_empty(interp, v, eqn)
    # After the semaphore checks: a DMA never waited for is reported as that.
    for c, key in zip(cells, shared):
        if key is None or scopes.leave(key):
            interp.free_cell(c)
    return outs


@rule(compat.run_state_p)
def _run_state(interp, eqn, *args):
    """``pl.run_state`` inside a kernel: fresh cells for the values it starts from
    (Refs it closes over are used in place); returns every Ref's final value."""
    p = eqn.params
    args, views, cells = iter(args), [], []
    for i, (aval, init) in enumerate(zip(p["jaxpr"].in_avals, p["is_initialized"])):
        val = next(args) if init else None
        if isinstance(val, RefView):
            views.append(val)
            continue
        inner = aval.inner_aval
        if val is None:
            val = interp.memory.fresh(inner.shape, inner.dtype)
        cells.append(interp.new_cell(jnp.asarray(val, inner.dtype), f"pl.run_state buffer {i}"))
        views.append(RefView(cells[-1]))
    interp.eval_jaxpr(p["jaxpr"], (), views)
    outs = [interp.read_view(v, eqn) for v in views]
    for c in cells:
        interp.free_cell(c)
    return outs


def check_sem_zero(interp, view, eqn, when):
    """Records an error if the semaphore ``view`` is not zero ``when`` (a DMA or signal not waited for)."""
    flat = interp.state[view.cell].reshape(-1)
    if flat.size <= 16:  # scalar selects, which XLA fuses into the check's: no reductions to compile
        elems = [lax.squeeze(lax.slice(flat, (i,), (i + 1,)), (0,)) for i in range(flat.size)]
        ok, first = lax.full((), True), lax.full((), 0, flat.dtype)
        for x in reversed(elems):
            nonzero = lax.ne(x, lax.full((), 0, flat.dtype))
            ok = lax.bitwise_and(ok, lax.bitwise_not(nonzero))
            first = lax.select(nonzero, x, first)
    else:
        ok, first = jnp.logical_not(jnp.any(flat != 0)), flat[jnp.argmax(flat != 0)]
    interp.check(
        ok,
        f"{interp.where(eqn) if eqn is not None else interp.kernel_desc}: semaphore "
        f"{interp.describe_ref(view)} is not zero {when} (a DMA or signal was not waited for; "
        "first nonzero value {0})",
        [first],
    )


# -- semaphores --


def _sem_view(ops, tree):
    return ops[0].with_transforms(plb.unflatten_transforms(tree, ops[1 : 1 + tree.num_leaves]))


@rule(plb.semaphore_signal_p)
def _signal(interp, eqn, *ops):
    p = eqn.params
    view = _sem_view(ops, p["sem_tree"])
    rest = ops[1 + p["sem_tree"].num_leaves :]
    inc, rest = rest[0], rest[1:]
    n_dev = p["device_id_tree"].num_leaves if p["device_id_tree"] is not None else 0
    dev, core = rest[:n_dev], rest[n_dev:]
    if p["device_id_tree"] is not None or core:
        interp.remote_signal(
            eqn,
            view,
            inc,
            tree_util.tree_unflatten(p["device_id_tree"], dev) if n_dev else None,
            core[0] if core else None,
        )
        return []
    interp.sem_add(view, inc, eqn)
    return []


@rule(plb.semaphore_wait_p)
def _sem_wait(interp, eqn, *ops):
    p = eqn.params
    view = _sem_view(ops, p["sem_tree"])
    value = ops[1 + p["sem_tree"].num_leaves]
    interp.sem_wait(view, value, eqn, decrement=p["decrement"])
    return []


@rule(plb.semaphore_read_p)
def _sem_read(interp, eqn, *ops):
    return interp.read_view(_sem_view(ops, eqn.params["sem_tree"]), eqn)


@rule(tpu_prims.get_barrier_semaphore_p)
def _barrier(interp, eqn):
    if interp.barrier_cell is None:
        raise NotImplementedError(
            f"{interp.where(eqn)}: barrier semaphores need the multi-device TPU interpreter"
        )
    return RefView(interp.barrier_cell)


rules.ITER_RULES[plb.run_scoped_p] = _iter_run_scoped
rules.ITER_RULES[compat.cond_p] = _iter_cond
