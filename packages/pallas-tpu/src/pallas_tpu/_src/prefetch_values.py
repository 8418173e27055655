"""The values of each kernel's scalar-prefetch operands, for ``pltpu.estimate``.

A kernel's scalar-prefetch operands (sequence lengths, page tables, group offsets, a block
mask's tables) steer its grid: which blocks its DMAs fetch, which steps compute, how often an
inner loop runs. The simulator runs the scalar unit exactly only where it knows them. This
module traces the function (as ``estimate`` compiles it), walks its jaxpr in program order and
evaluates, on the host's CPU, every equation whose inputs are known (concrete arguments,
constants of the trace such as a mask's tables computed by NumPy), so each ``pallas_call``'s
scalar-prefetch operands come out as NumPy arrays where they follow from what the caller gave,
``None`` where they depend on an argument given only as a shape (a ``ShapeDtypeStruct``) or on
a kernel's output.
"""

from __future__ import annotations

import contextlib

import numpy as np

from pallas_tpu._src.jaxpr_env import Env

_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # the sub-program of a call-like equation
_BIG = 1 << 24  # elements: larger intermediates are not evaluated (left unknown)


def _jaxpr_of(p):
    """(jaxpr, consts) of a ClosedJaxpr or a Jaxpr, else None."""
    if hasattr(p, "jaxpr") and hasattr(p, "consts"):
        return p.jaxpr, list(p.consts)
    if hasattr(p, "eqns") and hasattr(p, "invars"):
        return p, []
    return None


def _sub_programs(params: dict) -> list:
    out = []
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            j = _jaxpr_of(x)
            if j is not None:
                out.append(j[0])
    return out


def _count_calls(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == "pallas_call"
        n += sum(_count_calls(j) for j in _sub_programs(e.params))
    return n


def _small(aval) -> bool:
    """Whether to evaluate an equation's result here: integers and booleans (what indices and
    tables are made of) up to ``_BIG`` elements, anything of up to 64 Ki elements."""
    try:
        n = int(np.prod(aval.shape or (1,)))
        kind = np.dtype(aval.dtype).kind
    except Exception:  # noqa: BLE001 (no shape, or an extended dtype such as a PRNG key's)
        return False
    return n <= (_BIG if kind in "biu" else 1 << 16)


def _known(x) -> bool:
    return x is not None


class _Walk:
    def __init__(self, cpu):
        self.cpu = cpu
        self.calls: list[dict[int, np.ndarray]] = []

    def run(self, jaxpr, consts: list, args: list) -> list:
        env = Env(jaxpr, consts, args)  # what it could not evaluate is absent: read as None
        for e in jaxpr.eqns:
            env.bind(e.outvars, self.eqn(e, [env.read_known(v) for v in e.invars]))
        return [env.read_known(v) for v in jaxpr.outvars]

    def eqn(self, e, vals) -> list:
        n_out = len(e.outvars)
        if e.primitive.name == "pallas_call":
            gm = e.params["grid_mapping"]
            head = gm.num_dynamic_grid_bounds
            pre = vals[head : head + gm.num_scalar_prefetch]
            # the custom call's operands: the dynamic grid sizes, then the scalar-prefetch ones
            self.calls.append({head + i: np.asarray(x) for i, x in enumerate(pre) if _known(x)})
            return [None] * n_out
        sub = next((_jaxpr_of(e.params[k]) for k in _CALLS if k in e.params), None)
        if sub is not None and len(sub[0].invars) == len(vals) and len(sub[0].outvars) == n_out:
            return self.run(sub[0], sub[1], vals)  # pjit, closed_call, custom_jvp/vjp, remat
        inner = sum(_count_calls(j) for j in _sub_programs(e.params))
        if inner:  # a loop or a branch holding kernels: their operands unknown
            self.calls.extend({} for _ in range(inner))
            return [None] * n_out
        if not all(_known(x) for x in vals) or not all(_small(v.aval) for v in e.outvars):
            return [None] * n_out
        try:
            import jax

            with jax.default_device(self.cpu):
                out = e.primitive.bind(*vals, **e.params)
        except Exception:  # noqa: BLE001 (a primitive that does not run here: its result unknown)
            return [None] * n_out
        return list(out) if e.primitive.multiple_results else [out]


def prefetch_values(fn, args, kwargs, traced) -> list[dict[int, np.ndarray]]:
    """Per ``pallas_call`` of ``jax.jit(fn)(*args, **kwargs)`` in program order, the values of
    its scalar-prefetch operands known from ``args`` and the trace's constants, by their index
    among the kernel's operands (the custom call's). ``traced``: the context the
    compile traces in (the chip's), so the kernels are the ones compiled. Returns [] where the
    function cannot be traced or evaluated here."""
    import jax

    with contextlib.suppress(Exception):
        flat, tree = jax.tree.flatten((args, kwargs or {}))
        arrays = [i for i, x in enumerate(flat) if hasattr(x, "dtype") and hasattr(x, "shape")]
        shapes = [jax.ShapeDtypeStruct(np.shape(flat[i]), flat[i].dtype) for i in arrays]
        concrete = [
            None if isinstance(flat[i], jax.ShapeDtypeStruct) else np.asarray(flat[i]) for i in arrays
        ]

        def flat_fn(*xs):  # the arrays traced, any other argument (a flag, a config) as given
            leaves = list(flat)
            for i, x in zip(arrays, xs):
                leaves[i] = x
            a, k = jax.tree.unflatten(tree, leaves)
            return fn(*a, **k)

        with traced:
            closed = jax.make_jaxpr(flat_fn)(*shapes)
        walk = _Walk(jax.devices("cpu")[0])
        walk.run(closed.jaxpr, list(closed.consts), concrete)
        return walk.calls
    return []
