"""The backend registry: self-registered backends and entry points."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
from pallas import backend as pallas_backend
from pallas._src import backends


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(backends, "_registered", {})
    monkeypatch.setattr(backends, "_backends", {})  # entry points: none found
    return backends


class FakeParams(pl.CompilerParams):
    PLATFORM = "fakeplat"


class OtherParams(pl.CompilerParams):
    PLATFORM = "fakeplat"


def fake_backend(params_type):
    return types.SimpleNamespace(PLATFORMS=("fakeplat",), COMPILER_PARAMS=params_type, lower=None)


def test_registered_backend_is_found_without_scanning_entry_points(registry, monkeypatch):
    b = fake_backend(FakeParams)
    pallas_backend.register_backend("fake", b)
    monkeypatch.setattr(backends, "_load", lambda: pytest.fail("scanned the entry points"))
    assert registry.for_platform("fakeplat") is b
    assert registry.for_platform("fakeplat", FakeParams()) is b


def test_entry_points_are_scanned_when_no_registered_backend_matches(registry):
    registered, from_entry_point = fake_backend(FakeParams), fake_backend(OtherParams)
    pallas_backend.register_backend("fake", registered)
    registry._backends["other"] = from_entry_point
    assert registry.for_platform("fakeplat", OtherParams()) is from_entry_point
    assert registry.for_platform("otherplat") is None
    assert set(registry.backends()) == {"fake", "other"}


# -- the contract: one call record, the Backend protocol -------------------------------


def _pallas_call_eqn(f, *args):
    (eqn,) = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive is pl.pallas_call_p]
    return eqn


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def test_params_are_the_call_record():
    """pallas_call binds one PallasCall's fields (metadata included); the lowering
    rebuilds the record from them."""
    x = jnp.ones((8, 128), jnp.float32)
    f = pl.pallas_call(_add_one, x, metadata={"b": "2", "a": 1}, name="add")
    eqn = _pallas_call_eqn(f, x)
    call = pallas_backend.PallasCall(**eqn.params)
    assert call.params() == eqn.params
    assert call.metadata == (("a", 1), ("b", "2"))
    assert call.grid_mapping.kernel_name == "add"
    assert call.facts.uses(jax.lax.add_p) and not call.facts.remote


def test_kernel_walked_once(monkeypatch):
    """The kernel's facts are found by one walk when pallas_call traces it; lowering
    and interpreting read them."""
    from pallas._src import call as call_module

    walks = []
    real = call_module.kernel_facts
    monkeypatch.setattr(call_module, "kernel_facts", lambda j: walks.append(j) or real(j))
    x = jnp.ones((8, 128), jnp.float32)
    out = jax.jit(pl.pallas_call(_add_one, x, interpret=True))(x)
    assert len(walks) == 1
    np.testing.assert_array_equal(out, x + 1)


def test_aliases_count_scalar_prefetch_operands():
    """input_output_aliases are bound in JAX's convention (scalar-prefetch operands
    counted); block_aliases count the block mappings."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    idx = jnp.array([0], jnp.int32)

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((8, 128), lambda i, idx: (idx[0], 0))
    try:
        import pallas_tpu as pltpu
    except ImportError:
        pytest.skip("scalar prefetch needs pallas-tpu's grid spec")
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,), in_specs=[spec], out_specs=spec)
    f = pl.pallas_call(kernel, x, grid_spec=gs, input_output_aliases={1: 0})
    call = pallas_backend.PallasCall(**_pallas_call_eqn(f, idx, x).params)
    assert call.input_output_aliases == ((1, 0),)
    assert call.block_aliases == ((0, 0),)


def test_gpu_backend_implements_the_protocol():
    try:
        from pallas_gpu._src import pallas_call_registration as backend
    except ImportError as e:
        pytest.skip(f"pallas-gpu does not import: {e}")
    assert isinstance(backend, pallas_backend.Backend)


def test_tpu_backend_implements_the_protocol():
    try:
        from pallas_tpu._src import pallas_call_registration as backend
    except ImportError as e:
        pytest.skip(f"pallas-tpu does not import: {e}")
    assert isinstance(backend, pallas_backend.Backend)
