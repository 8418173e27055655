"""Names JAX's Pallas removed or moved (``pl.dot``, ``pltpu.semaphore_signal``,
...): code written for an older JAX gets an ``AttributeError`` in JAX's words
and the replacement, as JAX 0.11 gives it (ejkernel's Triton kernel calls
``pl.dot``: JAX said what to use instead, ours said only "no attribute"). The
reference is JAX's own table (``_deprecations`` of its modules)."""

from __future__ import annotations

import importlib
import re
import warnings

import jax
import pytest

import pallas as pl

TPU = pytest.importorskip("pallas_tpu")


# Names JAX removed that ours keeps, deprecated (a DeprecationWarning in JAX's words), and why.
KEPT_DEPRECATED = {
    "pallas_tpu": {
        "create_tensorcore_mesh": (
            "JAX 0.12.1 removed it, but JAX 0.10.2 (our oldest supported JAX) has no "
            "TensorCoreMesh: code written for it has only this name"
        ),
    },
}


def jax_table(module: str) -> dict:
    return importlib.import_module(module)._deprecations


@pytest.mark.parametrize(
    "ours, theirs",
    [("pallas", "jax.experimental.pallas"), ("pallas_tpu", "jax.experimental.pallas.tpu")],
)
def test_removed_names_say_what_jax_says(ours, theirs):
    removed = {name: msg for name, (msg, obj) in jax_table(theirs).items() if obj is None}
    if jax.__version_info__ < (0, 11):
        pytest.skip(
            f"JAX {jax.__version__} removed none of these names yet: its table has no wording to match"
        )
    assert removed  # JAX 0.11 and 0.12 list some
    kept = KEPT_DEPRECATED.get(ours, {})
    for name, message in removed.items():
        if name in kept:  # warns in JAX's words and works
            with pytest.warns(DeprecationWarning) as record:
                assert getattr(importlib.import_module(ours), name) is not None
            assert any(str(w.message).startswith(message) for w in record), name
            continue
        with pytest.raises(AttributeError) as err:
            getattr(importlib.import_module(ours), name)
        assert str(err.value).startswith(message), name


@pytest.mark.parametrize("ours, name", [(m, n) for m, names in KEPT_DEPRECATED.items() for n in names])
def test_kept_names_warn_in_jax_words_and_work(ours, name):
    """On every JAX (0.10's has the name, 0.11's deprecates it, 0.12.1's removed it)."""
    from pallas_tpu._src.removed import PALLAS_TPU

    message = PALLAS_TPU[name][0]
    jax_message = jax_table("jax.experimental.pallas.tpu").get(name, (message,))[0]
    assert message == jax_message  # JAX's words where JAX has words (0.11+)
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        make = getattr(importlib.import_module(ours), name)
    mesh = make("x", num_cores=2)
    assert mesh == TPU.TensorCoreMesh(axis_name="x", num_cores=2)


def test_moved_names_warn_and_work():
    from pallas._src.removed import PALLAS

    moved = [n for n, (_, target) in PALLAS.items() if target is not None]
    assert moved == ["reciprocal"]
    with pytest.warns(DeprecationWarning, match="moved to pltpu"):
        f = pl.reciprocal
    assert f is TPU.reciprocal


def test_repeat_says_what_to_use():
    with pytest.raises(AttributeError, match="pltpu.repeat was removed .* use jnp.tile"):
        TPU.repeat  # noqa: B018


def test_other_names_are_plain_attribute_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="module 'pallas' has no attribute 'no_such_name'"):
            pl.no_such_name  # noqa: B018
        assert not hasattr(TPU, "no_such_name")
