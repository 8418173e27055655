"""pallas-gpu's own disk cache of compiled kernels (no GPU needed: kernels
are compiled for sm_90 through ``compiler.compiled_configs``, the entry point
the GPU lowering uses)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src import compiler
from pallas_gpu._src.pallas_call_registration import lowered_kernel

# Builds one kernel and compiles it for sm_90 through the GPU path's entry
# point. With "forbid", compiling or importing the generated module raises.
_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import jax, jax.numpy as jnp
    import pallas as pl, pallas_gpu as plgpu
    from pallas_gpu._src import compiler
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    if sys.argv[1] == "forbid":
        import triton

        def forbidden(*a, **k):
            raise AssertionError("triton.compile called although the kernel is in the disk cache")

        def no_import(*a, **k):
            raise AssertionError("generated module imported although the kernel is in the disk cache")

        triton.compile = forbidden
        compiler.compile_kernel = forbidden
        compiler.load_kernel = no_import

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * 3.0 + y_ref[...]

    x = jnp.ones((4096,), jnp.float32)
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(4,),
        in_specs=[pl.BlockSpec((1024,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
    )
    eqn = [e for e in jax.make_jaxpr(f)(x, x).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
    lk = lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"])
    ((cp, cfg),) = compiler.compiled_configs(lk, 90, [plgpu.CompilerParams(num_warps=2)])
    print(hashlib.sha256(cfg.image).hexdigest(), cfg.function, cfg.block_dims, cfg.shared_memory_bytes)
    """
)


def _run(tmp_path, mode, **env):
    env = {**os.environ, "PALLAS_GPU_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu", **env}
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_second_process_uses_disk_cache(tmp_path):
    first = _run(tmp_path, "compile")
    entries = list((tmp_path / "cache" / "kernels").rglob("*.bin"))
    assert len(entries) == 1
    second = _run(tmp_path, "forbid")
    assert second == first
    assert "(64, 1, 1)" in first  # num_warps=2 -> 64 threads


def test_disabled_cache_compiles_again(tmp_path):
    _run(tmp_path, "compile", PALLAS_GPU_DISABLE_CACHE="1")
    assert not (tmp_path / "cache" / "kernels").exists()


def _add_kernel(n=2048):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((n,), jnp.float32)
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n // 512,),
        in_specs=[pl.BlockSpec((512,), lambda i: (i,))],
        out_specs=pl.BlockSpec((512,), lambda i: (i,)),
    )
    eqn = [e for e in jax.make_jaxpr(f)(x).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
    return lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLAS_GPU_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PALLAS_GPU_DISABLE_CACHE", raising=False)
    compiler.clear_memory_cache()
    yield tmp_path
    compiler.clear_memory_cache()


def test_truncated_entry_is_a_miss(cache_dir):
    lk = _add_kernel()
    cp = plgpu.CompilerParams()
    cfg = compiler.compiled_config(lk, 90, cp)
    (path,) = (cache_dir / "kernels").rglob("*.bin")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    compiler.clear_memory_cache()
    assert compiler.compiled_config(lk, 90, cp) == cfg  # compiled again ...
    assert path.read_bytes() == data  # ... and the whole entry written back


def test_memory_cache_in_front_of_disk(cache_dir):
    lk = _add_kernel()
    cp = plgpu.CompilerParams(num_warps=1)
    cfg = compiler.compiled_config(lk, 80, cp)
    for p in (cache_dir / "kernels").rglob("*.bin"):
        p.unlink()
    assert compiler.compiled_config(lk, 80, cp) is cfg
    assert not list((cache_dir / "kernels").rglob("*.bin"))


def test_key_covers_target_and_options():
    lk = _add_kernel()
    opts = tuple(sorted(plgpu.CompilerParams().compile_options().items()))
    opts8 = tuple(sorted(plgpu.CompilerParams(num_warps=8).compile_options().items()))
    keys = {
        compiler.cache_key(lk, 90, opts),
        compiler.cache_key(lk, 80, opts),
        compiler.cache_key(lk, 90, opts8),
    }
    assert len(keys) == 3
    assert compiler.cache_key(lk, 90, opts) == compiler.cache_key(_add_kernel(), 90, opts)
    assert compiler.cache_key(lk, 90, opts) != compiler.cache_key(_add_kernel(4096), 90, opts)
