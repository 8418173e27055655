"""Reads through zero-stride slices, ``x_ref[:, pl.ds(i, n, 0)]``: the element at ``i``,
``n`` times (a broadcast along that dimension; tokamax's quantized matmuls read a scale
row this way). JAX's TPU lowering reads them with a strided load of stride 0, and so does
ours; JAX's state discharge and the Triton lowering cannot (``lax.slice`` takes no zero
stride). ``broadcast_zero_stride_reads`` rewrites each such read of a kernel's jaxpr into a
read of one element along the dimension and a ``broadcast_in_dim``, for the backends
that interpret or lower the jaxpr themselves (pallas-core's interpret mode, the TPU
interpreter, pallas-gpu). Handled: the last indexer of a read, with scalar integer
indices; anything else keeps the zero stride (and the backend's own error). A write
through a zero-stride slice names the same element several times: refused here (what a
TPU does with it is not defined by JAX's docs).
"""

from __future__ import annotations

import jax
from jax import tree_util
from jax.extend import core as jax_core

from pallas._src import compat


def _zero_stride(eqn) -> bool:
    return any(
        isinstance(i, compat.Slice) and i.stride == 0 for ix in compat.ref_indexers(eqn) for i in ix.indices
    )


def _has_zero_stride(jaxpr, where: str) -> bool:
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    found = False
    for eqn in inner.eqns:
        if eqn.primitive is compat.state_primitives.get_p:
            found = found or _zero_stride(eqn)
        elif eqn.primitive in (compat.state_primitives.swap_p, compat.state_primitives.addupdate_p):
            if _zero_stride(eqn):
                line = compat.eqn_user_source(eqn) or "<unknown>"
                raise NotImplementedError(
                    f"{where}: in the kernel at {line}: a write through pl.ds(start, size, stride=0) names one element "
                    "size times; write it once (pl.ds(start, 1)) or index with a stride >= 1 "
                    "(zero strides are for reads: a broadcast)"
                )
        found = any([_has_zero_stride(s, where) for s in jax_core.jaxprs_in_params(eqn.params)]) or found
    return found


def check_zero_stride_writes(jaxpr, where: str = "pallas_call") -> None:
    """Raises ``NotImplementedError`` naming ``where`` and the line for a write through a
    zero-stride slice (for lowerings that read zero strides natively)."""
    _has_zero_stride(jaxpr, where)


def broadcast_zero_stride_reads(jaxpr, where: str = "pallas_call"):
    """``jaxpr`` (closed or not) with its zero-stride reads broadcast; itself when it has
    none. A write through a zero-stride slice raises ``NotImplementedError`` naming
    ``where`` (the kernel) and the line."""
    return _rewrite(jaxpr) if _has_zero_stride(jaxpr, where) else jaxpr


def _rewrite(jaxpr):
    """``jaxpr`` with its zero-stride reads broadcast; the same object when it has none."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    if inner is not jaxpr:  # a ClosedJaxpr wrapper (JAX < 0.11 layout)
        new = _rewrite(inner)
        return jaxpr if new is inner else jaxpr.replace(jaxpr=new)
    eqns = []
    for eqn in inner.eqns:
        params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
        if any(params[k] is not eqn.params[k] for k in params):
            eqn = eqn.replace(params=params)
        eqns.extend(_rewrite_read(eqn) if eqn.primitive is compat.state_primitives.get_p else [eqn])
    if len(eqns) == len(inner.eqns) and all(a is b for a, b in zip(eqns, inner.eqns)):
        return inner
    return inner.replace(eqns=eqns)


def _rewrite_param(v):
    if isinstance(v, (compat.Jaxpr, compat.ClosedJaxpr)):
        return _rewrite(v)
    if isinstance(v, tuple) and any(isinstance(x, (compat.Jaxpr, compat.ClosedJaxpr)) for x in v):
        new = tuple(_rewrite_param(x) for x in v)
        return new if any(a is not b for a, b in zip(new, v)) else v
    return v


def _rewrite_read(eqn):
    transforms = tree_util.tree_unflatten(eqn.params["tree"], eqn.invars[1:])
    last = transforms[-1] if transforms else None
    if not isinstance(last, compat.state_indexing.NDIndexer) or last.int_indexer_shape != ():
        return [eqn]
    slices = [i for i in last.indices if isinstance(i, compat.Slice)]
    if not any(s.stride == 0 for s in slices):
        return [eqn]
    indices = tuple(
        compat.Slice(i.start, 1, 1) if isinstance(i, compat.Slice) and i.stride == 0 else i
        for i in last.indices
    )
    indexer = compat.state_indexing.NDIndexer(indices, last.shape, (), validate=False)
    flat, tree = tree_util.tree_flatten((*transforms[:-1], indexer))
    out = eqn.outvars[0]
    shape = tuple(1 if s.stride == 0 else d for s, d in zip(slices, out.aval.shape))
    one = jax_core.Var(out.aval.update(shape=shape))
    read = eqn.replace(invars=[eqn.invars[0], *flat], outvars=[one], params={**eqn.params, "tree": tree})
    bcast = jax_core.new_jaxpr_eqn(
        [one],
        [out],
        jax.lax.broadcast_in_dim_p,
        {"shape": tuple(out.aval.shape), "broadcast_dimensions": tuple(range(len(shape))), "sharding": None},
        frozenset(),
        eqn.source_info,
        eqn.ctx,
    )
    return [read, bcast]
