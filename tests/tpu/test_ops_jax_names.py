"""Every public name of JAX's TPU ops modules (``jax.experimental.pallas.ops.tpu`` and each of its
submodules, read from the installed JAX) exists in ``pallas_tpu.ops`` under the same module path,
and each function or class takes the same parameters (names, kinds, and which have defaults), so
that code written against JAX's modules runs with the import changed. ``KNOWN`` lists each
exception with its reason; a name that JAX adds or one that ours gains shows here, on the oldest
and the newest JAX CI runs.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

jops = pytest.importorskip("jax.experimental.pallas.ops.tpu")

JAX_ROOT = jops.__name__
OURS_ROOT = "pallas_tpu.ops"

# (module path under ops/tpu, name) -> why ours differs. A name listed here that ours has with
# JAX's signature fails the test, so the list stays true.
KNOWN: dict[tuple[str, str], str] = {}


def _jax_modules():
    out = [JAX_ROOT]
    for info in pkgutil.walk_packages(jops.__path__, JAX_ROOT + "."):
        out.append(info.name)
    return out


def _public(module) -> dict[str, object]:
    """The names a caller reaches: public, defined by JAX's ops package (not re-exported from
    typing, numpy or JAX's core), and not submodules (those are compared as modules)."""
    names = {}
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        home = getattr(value, "__module__", None)
        if (inspect.isfunction(value) or inspect.isclass(value)) and not (home or "").startswith(JAX_ROOT):
            continue
        if name == "annotations" or type(value).__module__ == "typing" or home == "typing":
            continue  # `from __future__ import annotations`, `from typing import Literal`
        names[name] = value
    return names


def _shape(fn) -> list[tuple[str, inspect._ParameterKind, bool]] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]


def _compatible(theirs, ours) -> str | None:
    """Why a call written for JAX's signature would not bind to ours (None: it would)."""
    if theirs is None or ours is None:
        return None
    ours_named = {o[0]: o for o in ours}
    for name, kind, has_default in theirs:
        mine = ours_named.get(name)
        if mine is None:
            if (
                any(o[1] is inspect.Parameter.VAR_KEYWORD for o in ours)
                and kind is not inspect.Parameter.POSITIONAL_ONLY
            ):
                continue
            return f"no parameter {name!r}"
        if mine[1] != kind and not (
            kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            and mine[1] is inspect.Parameter.KEYWORD_ONLY
            and has_default
        ):
            return f"parameter {name!r} is {mine[1].name}, JAX's is {kind.name}"
        if has_default and not mine[2]:
            return f"parameter {name!r} has no default (JAX's has)"
    theirs_names = {t[0] for t in theirs}
    for name, kind, has_default in ours:
        if name in theirs_names or kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        if not has_default:
            return f"ours requires {name!r}, JAX's has no such parameter"
    return None


def _differences() -> dict[tuple[str, str], str]:
    found = {}
    for jname in _jax_modules():
        rel = jname[len(JAX_ROOT) + 1 :]
        try:
            jmod = importlib.import_module(jname)
        except Exception:  # a module JAX's own import cannot load on this host: nothing to match
            continue
        try:
            omod = importlib.import_module(f"{OURS_ROOT}.{rel}" if rel else OURS_ROOT)
        except ImportError as e:
            found[(rel, "<module>")] = f"module missing ({e})"
            continue
        for name, value in _public(jmod).items():
            if not hasattr(omod, name):
                found[(rel, name)] = "missing"
                continue
            if callable(value) and (inspect.isfunction(value) or inspect.isclass(value)):
                why = _compatible(_shape(value), _shape(getattr(omod, name)))
                if why:
                    found[(rel, name)] = why
    return found


def test_every_jax_ops_name_exists_with_a_compatible_signature():
    found = _differences()
    unexplained = {k: v for k, v in found.items() if k not in KNOWN}
    assert not unexplained, "\n".join(f"{m or '.'}.{n}: {why}" for (m, n), why in sorted(unexplained.items()))


def test_known_differences_are_still_differences():
    found = _differences()
    stale = sorted(k for k in KNOWN if k not in found)
    assert not stale, f"listed in KNOWN but ours now matches JAX's: {stale}"


def test_example_kernel_doubles():
    import jax
    import numpy as np

    import pallas_tpu as pltpu
    from pallas_tpu.ops import example_kernel

    x = jax.random.normal(jax.random.key(3), (16, 256))
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = jax.jit(example_kernel.double)(x)
    np.testing.assert_array_equal(np.asarray(got), 2 * np.asarray(x))


def test_min_heads_per_block_answers_as_jaxs():
    import itertools

    import jax.numpy as jnp

    from pallas_tpu.ops.ragged_paged_attention import kernel as ours

    theirs = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
    dtypes = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)
    checked = 0
    for kv_heads, group, q_dtype, kv_dtype in itertools.product(
        (1, 2, 3, 4, 8, 12, 16), (1, 2, 4, 7), dtypes[:2], dtypes
    ):
        args = (kv_heads * group, 2 * kv_heads, q_dtype, kv_dtype)
        try:
            want = theirs.get_min_heads_per_blk(*args)
        except (ValueError, AssertionError):
            with pytest.raises(ValueError, match="get_min_heads_per_blk"):
                ours.get_min_heads_per_blk(*args)
            continue
        assert ours.get_min_heads_per_blk(*args) == want, args
        checked += 1
    assert checked > 50
