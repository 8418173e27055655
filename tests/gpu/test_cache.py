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
import numpy as np
import pytest

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler
from pallas_gpu._src.pallas_call_registration import lowered_kernel

# Builds one kernel and compiles it for sm_90 through the GPU path's entry
# point. With "forbid", compiling or importing the generated module raises.
_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import jax, jax.numpy as jnp
    import pallas as pl, pallas_gpu as plgpu
    from pallas_gpu._src.compile import compiler
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


# ---------------------------------------------------------------------------
# The cache's files are never trusted


def _times3(interpret):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3.0

    return pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((1024,), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((512,), lambda i: (i,))],
        out_specs=pl.BlockSpec((512,), lambda i: (i,)),
        interpret=interpret,
    )


def _edit_sources(cache_dir, suffix):
    (path,) = (cache_dir / "src").glob(f"*{suffix}*.py")
    original = path.read_text()
    assert "3.0" in original
    path.write_text(original.replace("3.0", "4.0"))
    return path, original


def test_edited_generated_source_is_rewritten_not_run(cache_dir):
    x = jax.random.normal(jax.random.key(0), (1024,), jnp.float32)
    f = _times3(plgpu.InterpretParams())
    np.testing.assert_allclose(f(x), x * 3.0, rtol=1e-6)
    path, original = _edit_sources(cache_dir, "interp")
    compiler.clear_memory_cache()
    jax.clear_caches()
    np.testing.assert_allclose(_times3(plgpu.InterpretParams())(x), x * 3.0, rtol=1e-6)
    assert path.read_text() == original


def test_edited_generated_source_is_not_compiled_under_the_original_key(cache_dir):
    lk = _add_kernel()
    cp = plgpu.CompilerParams()
    cfg = compiler.compiled_config(lk, 90, cp)
    (path,) = (cache_dir / "src").glob("*gpu*.py")
    original = path.read_text()
    path.write_text(original.replace("+ 1.0", "+ 2.0"))
    for p in (cache_dir / "kernels").rglob("*.bin"):
        p.unlink()
    compiler.clear_memory_cache()
    assert compiler.compiled_config(lk, 90, cp).image == cfg.image
    assert path.read_text() == original


def test_entry_written_for_another_key_is_a_miss(cache_dir):
    lk, cp = _add_kernel(), plgpu.CompilerParams()
    cfg = compiler.compiled_config(lk, 90, cp)
    other = compiler.compiled_config(lk, 80, cp)
    (path90,) = (cache_dir / "kernels").rglob(compiler.cache_key(lk, 90, _opts(cp)) + ".bin")
    (path80,) = (cache_dir / "kernels").rglob(compiler.cache_key(lk, 80, _opts(cp)) + ".bin")
    path90.write_bytes(path80.read_bytes())  # a whole, valid entry, but of sm_80
    compiler.clear_memory_cache()
    assert compiler.compiled_config(lk, 90, cp) == cfg != other


def _opts(cp):
    return tuple(sorted(cp.compile_options().items()))


_UNWRITABLE_SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp, numpy as np
    import pallas as pl, pallas_gpu as plgpu
    from pallas_gpu._src.compile import compiler
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    def call(scale, interpret):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * scale
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((256,), jnp.float32), grid=(2,),
            in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
            out_specs=pl.BlockSpec((128,), lambda i: (i,)), interpret=interpret,
        )

    x = jnp.arange(256, dtype=jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        for scale in (2.0, 3.0):
            np.testing.assert_allclose(call(scale, plgpu.InterpretParams())(x), x * scale)
            f = call(scale, False)
            eqn = [e for e in jax.make_jaxpr(f)(x).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
            lk = lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"])
            ((_, cfg),) = compiler.compiled_configs(lk, 90, [plgpu.CompilerParams()])
            assert cfg.image
    ours = [str(w.message) for w in caught if "cannot write to the cache directory" in str(w.message)]
    print(len(ours), ours[0] if ours else "")
    """
)


def _run_unwritable(cache, **env):
    env = {**os.environ, "PALLAS_GPU_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu", **env}
    r = subprocess.run(
        [sys.executable, "-c", _UNWRITABLE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_cache_dir_that_is_a_file_warns_once_and_runs_uncached(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = _run_unwritable(blocker)
    assert out.startswith("1 pallas_gpu (PALLAS_GPU_CACHE_DIR): cannot write to the cache directory"), out
    assert str(blocker) in out and "running without the disk cache" in out
    assert _run_unwritable(blocker / "below", PALLAS_GPU_DISABLE_CACHE="1") == "0"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_cache_dir_warns_once_and_runs_uncached(tmp_path):
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        assert _run_unwritable(cache).startswith("1 pallas_gpu (PALLAS_GPU_CACHE_DIR): cannot write")
    finally:
        cache.chmod(0o755)


_GPU_UNWRITABLE_SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp, numpy as np
    import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    x = jax.random.normal(jax.random.key(1), (4096,), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        y = pl.pallas_call(
            kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
            in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
            out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
        )(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 2.0, rtol=1e-6)
    print(sum("cannot write to the cache directory" in str(w.message) for w in caught))
    """
)


@pytest.mark.gpu
def test_gpu_run_with_a_cache_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    env = {**os.environ, "PALLAS_GPU_CACHE_DIR": str(blocker), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
    env.pop("PALLAS_GPU_DISABLE_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-c", _GPU_UNWRITABLE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "1"
