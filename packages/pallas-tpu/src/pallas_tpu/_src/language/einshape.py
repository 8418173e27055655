"""``einshape``: reshape and transpose in one einsum-like equation.

An equation ``lhs->rhs`` names each dimension with one letter. Parentheses on
the left split a dimension (``(ab)c->abc``); on the right they merge
dimensions (``abc->(ab)c``); a different letter order is a transpose
(``nhwc->nchw``). Sizes of split dimensions that cannot be inferred are
passed as keywords (``einshape("a(bc)->bac", x, b=4)``). Broadcasting
(``a->1a``) and squeezing are not supported, as in JAX.

The op is one primitive so that the Mosaic lowering can emit a
tile-preserving relayout; its meaning is ``split reshape -> transpose ->
merge reshape``, which is also its interpret-mode semantics.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallas.backend import kernel_error, register_internal_dir
from pallas_tpu._src import compat

register_internal_dir(__file__)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How an equation maps ``in_shape``: reshape to ``split_shape`` (one
    axis per letter), transpose by ``perm``, reshape to ``out_shape``."""

    split_shape: tuple[int, ...]
    perm: tuple[int, ...]
    out_shape: tuple[int, ...]
    sizes: tuple[tuple[str, int], ...]  # every letter's size


def _parse_side(side: str, equation: str) -> list[tuple[str, ...]]:
    groups: list[tuple[str, ...]] = []
    s = side.replace(" ", "")
    i = 0
    while i < len(s):
        c = s[i]
        if c == "(":
            j = s.find(")", i)
            if j < 0 or "(" in s[i + 1 : j]:
                raise ValueError(f"einshape {equation!r}: unmatched '(' in {side!r}")
            group = tuple(s[i + 1 : j])
            if not group:
                raise ValueError(f"einshape {equation!r}: empty group '()' in {side!r}")
            groups.append(group)
            i = j + 1
        elif c == ")":
            raise ValueError(f"einshape {equation!r}: unmatched ')' in {side!r}")
        elif c.isalpha():
            groups.append((c,))
            i += 1
        else:
            raise ValueError(f"einshape {equation!r}: dimensions are named by letters, got {c!r}")
    letters = [c for g in groups for c in g]
    if len(set(letters)) != len(letters):
        raise ValueError(f"einshape {equation!r}: a letter appears twice in {side!r}")
    return groups


def plan(equation: str, in_shape: tuple[int, ...], sizes: dict[str, int]) -> _Plan:
    """Checks ``equation`` against ``in_shape`` and the given sizes."""
    if equation.count("->") != 1:
        raise ValueError(f"einshape {equation!r}: the equation needs exactly one '->'")
    lhs_s, rhs_s = equation.split("->")
    lhs, rhs = _parse_side(lhs_s, equation), _parse_side(rhs_s, equation)
    if len(lhs) != len(in_shape):
        raise ValueError(
            f"einshape {equation!r}: the left side has {len(lhs)} dimensions but the array has shape {in_shape}"
        )
    lhs_letters = [c for g in lhs for c in g]
    rhs_letters = [c for g in rhs for c in g]
    if set(lhs_letters) != set(rhs_letters):
        raise ValueError(
            f"einshape {equation!r}: both sides must name the same letters "
            f"(left {''.join(sorted(lhs_letters))}, right {''.join(sorted(rhs_letters))})"
        )
    unknown = set(sizes) - set(lhs_letters)
    if unknown:
        raise ValueError(
            f"einshape {equation!r}: sizes given for letters not in the equation: {sorted(unknown)}"
        )
    size: dict[str, int] = {}
    for group, dim in zip(lhs, in_shape, strict=True):
        if len(group) == 1:
            (c,) = group
            if c in sizes and sizes[c] != dim:
                raise ValueError(f"einshape {equation!r}: {c}={sizes[c]} but that dimension has size {dim}")
            size[c] = dim
            continue
        missing = [c for c in group if c not in sizes]
        known = math.prod(sizes[c] for c in group if c in sizes)
        if len(missing) > 1:
            raise ValueError(
                f"einshape {equation!r}: cannot split {dim} into ({''.join(group)}): "
                f"give the sizes of all but one of {missing} as keywords"
            )
        if missing:
            if known == 0 or dim % known:
                raise ValueError(
                    f"einshape {equation!r}: cannot split {dim} into ({''.join(group)}) with known sizes {known}"
                )
            size[missing[0]] = dim // known
        elif known != dim:
            raise ValueError(
                f"einshape {equation!r}: ({''.join(group)}) has size {known} but the dimension is {dim}"
            )
        size.update({c: sizes[c] for c in group if c in sizes})
    split_shape = tuple(size[c] for c in lhs_letters)
    perm = tuple(lhs_letters.index(c) for c in rhs_letters)
    out_shape = tuple(math.prod(size[c] for c in g) for g in rhs)
    return _Plan(split_shape, perm, out_shape, tuple((c, size[c]) for c in lhs_letters))


einshape_p = Primitive("einshape")


def einshape(
    equation: str, value: jax.Array, /, assert_is_tile_preserving: bool = False, **sizes: int
) -> jax.Array:
    """Reshapes and transposes ``value`` as an einshape equation says.

    Args:
      equation: e.g. ``"ab(cd)->cabd"``: letters name dimensions; ``(..)`` on
        the left splits one dimension, on the right merges several; the
        order of the right side is the transpose.
      value: the array.
      assert_is_tile_preserving: on a TPU, fail unless the change only
        reorders vector-register tiles. Interpret mode has no tiles and
        ignores it.
      **sizes: sizes of split dimensions that cannot be inferred (all but
        one per group). ``equation`` and ``value`` are positional-only, so
        any letter can be given a size.

    Returns:
      The reshaped, transposed array.
    """
    value = jnp.asarray(value)
    try:
        plan(equation, value.shape, sizes)
    except ValueError as e:
        raise kernel_error(ValueError, f"pltpu.{e}") from None
    return einshape_p.bind(
        value,
        equation=equation,
        sizes=tuple(sorted(sizes.items())),
        assert_is_tile_preserving=bool(assert_is_tile_preserving),
    )


@einshape_p.def_abstract_eval
def _einshape_abstract_eval(x, *, equation, sizes, assert_is_tile_preserving):
    del assert_is_tile_preserving
    return compat.ShapedArray(plan(equation, x.shape, dict(sizes)).out_shape, x.dtype)


def _einshape_impl(x, *, equation, sizes, assert_is_tile_preserving):
    del assert_is_tile_preserving
    p = plan(equation, x.shape, dict(sizes))
    return lax.transpose(x.reshape(p.split_shape), p.perm).reshape(p.out_shape)


def _einshape_batch(args, dims, *, equation, sizes, assert_is_tile_preserving):
    (x,), (d,) = args, dims
    x = x if d == 0 else jnp.moveaxis(x, d, 0)
    used = set(equation)
    b = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in used)
    lhs, rhs = equation.split("->")
    eq = f"{b}{lhs.strip()}->{b}{rhs.strip()}"
    return einshape_p.bind(
        x, equation=eq, sizes=sizes, assert_is_tile_preserving=assert_is_tile_preserving
    ), 0


def _einshape_transpose(ct, x, *, equation, sizes, assert_is_tile_preserving):
    p = plan(equation, x.aval.shape, dict(sizes))
    lhs, rhs = equation.split("->")
    return [
        einshape_p.bind(
            ct,
            equation=f"{rhs}->{lhs}",
            sizes=tuple(sorted(p.sizes)),
            assert_is_tile_preserving=assert_is_tile_preserving,
        )
    ]


einshape_p.def_impl(_einshape_impl)
batching.primitive_batchers[einshape_p] = _einshape_batch
ad.deflinear2(einshape_p, _einshape_transpose)
mlir.register_lowering(einshape_p, mlir.lower_fun(_einshape_impl, multiple_results=False))
