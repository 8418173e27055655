"""How plgpu's ``load``/``store``/``swap`` equations print: like JAX's Ref accesses
(``b:f32[8] <- a[:8]``, ``a[:8] <- b``, ``c:f32[8], a[:8] <- a[:8], b``), with the mask,
``other`` and Triton hints after the access when given."""

from __future__ import annotations

from jax import tree_util

from pallas_gpu._src import compat


def _pp_index(context, dim: int, idx):
    """One index of ``a[...]``: an array's name, or a slice ``1:``, ``:4``, ``::2``, ``i:i+8``."""
    text = compat.pp.text
    if not isinstance(idx, compat.Slice):
        return compat.pp_var(idx, context, print_literal_dtype=False)
    start, size, stride = idx.start, idx.size, idx.stride
    step = text("" if stride == 1 else f":{stride}")
    pp_size = compat.pp_var(size, context) if isinstance(size, compat.Var) else text(str(size))
    if isinstance(start, compat.Var):  # a dynamic window
        start_doc = compat.pp_var(start, context)
        return compat.pp.concat([start_doc, text(":"), start_doc, text("+"), pp_size, step])
    start = getattr(start, "val", start)
    lo = "" if start == 0 else str(start)
    if isinstance(size, compat.Var):
        return compat.pp.concat([text(f"{lo}:{lo}+" if lo else ":"), pp_size, step])
    end = start + (size - 1) * stride + 1
    return text(f"{lo}:{'' if end == dim else end}") + step


def _pp_ref(context, ref, transforms):
    """``a[:, 1:3, i]``: the Ref's variable and its indexers (other
    transforms, e.g. bitcasts, print themselves)."""
    docs = [compat.pp_var(ref, context)]
    for t in transforms:
        if isinstance(t, compat.NDIndexer):
            parts = [_pp_index(context, d, i) for d, i in zip(t.shape, t.indices)]
            docs += [compat.pp.text("["), compat.pp.join(compat.pp.text(","), parts), compat.pp.text("]")]
        else:
            docs.append(t.pretty_print(context))
    return compat.pp.concat(docs)


def _pp_extras(context, eqn, operands: dict) -> list:
    """`` mask=c other=d eviction_policy='evict_last'``: the operands given and the hints set."""
    docs = []
    for k, v in operands.items():
        if v is not None:
            docs += [compat.pp.text(f" {k}="), compat.pp_var(v, context)]
    for k in ("cache_modifier", "eviction_policy", "volatile"):
        if eqn.params.get(k):
            docs.append(compat.pp.text(f" {k}={eqn.params[k]!r}"))
    return docs


def _pp_arrow(eqn, settings):
    return compat.pp.text(" <- ", annotation=compat.source_line(eqn) if settings.source_info else None)


def _split(eqn, n_before: int):
    """(Ref, values before the indices, transforms, operands after them) of ``eqn``."""
    ref, *rest = eqn.invars
    before, rest = rest[:n_before], rest[n_before:]
    tree = eqn.params["tree"]
    transforms = tree_util.tree_unflatten(tree, rest[: tree.num_leaves])
    return ref, before, transforms, list(rest[tree.num_leaves :])


def _load_pp_rule(eqn, context, settings):
    ref, _, transforms, rest = _split(eqn, 0)
    mask = rest.pop(0) if eqn.params["has_mask"] else None
    other = rest.pop(0) if eqn.params["has_other"] else None
    lhs = compat.pp_vars(eqn.outvars, context, print_shapes=settings.print_shapes, is_binder=True)
    return compat.pp.concat(
        [lhs, _pp_arrow(eqn, settings), _pp_ref(context, ref, transforms)]
        + _pp_extras(context, eqn, {"mask": mask, "other": other})
    )


def _store_pp_rule(eqn, context, settings):
    ref, (val,), transforms, rest = _split(eqn, 1)
    mask = rest[0] if eqn.params["has_mask"] else None
    return compat.pp.concat(
        [_pp_ref(context, ref, transforms), _pp_arrow(eqn, settings), compat.pp_var(val, context)]
        + _pp_extras(context, eqn, {"mask": mask})
    )


def _swap_pp_rule(eqn, context, settings):
    ref, (val,), transforms, rest = _split(eqn, 1)
    mask = rest[0] if eqn.params["has_mask"] else None
    (out,) = eqn.outvars
    x_i = _pp_ref(context, ref, transforms)
    if isinstance(out, compat.DropVar) or context.var_names.get(out) == "_":  # a store
        head = [x_i, _pp_arrow(eqn, settings), compat.pp_var(val, context)]
    else:
        lhs = compat.pp_vars([out], context, print_shapes=settings.print_shapes, is_binder=True)
        head = [
            lhs,
            compat.pp.text(", "),
            x_i,
            _pp_arrow(eqn, settings),
            x_i,
            compat.pp.text(", "),
            compat.pp_var(val, context),
        ]
    return compat.pp.concat(head + _pp_extras(context, eqn, {"mask": mask}))


def register(load_p, store_p, swap_p) -> None:
    """Print ``load_p``, ``store_p`` and ``swap_p`` equations as above."""
    compat.pp_eqn_rules[load_p] = _load_pp_rule
    compat.pp_eqn_rules[store_p] = _store_pp_rule
    compat.pp_eqn_rules[swap_p] = _swap_pp_rule
