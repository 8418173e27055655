"""``ops.matmul``'s Hopper kernels (the Gluon kernels of
``pallas_gpu.ops._matmul_sm90_kernel``): which products have them among the
autotuner's candidates, that they compile for sm_90 on any machine (Triton's
interpreter does not run Gluon) and lower from a CPU, the errors of an
``Sm90Config`` that cannot run, and, on an sm_90 GPU, their results against
``jnp.dot`` in f32 on fresh random data, edge tiles and ``vmap`` included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import fresh_key, has_gpu

from jax_kernel_runtime.triton import SHARED_MEMORY_LIMITS
from pallas_gpu.ops import _common, _matmul_sm90
from pallas_gpu.ops import matmul as mm

F32 = jnp.float32
BF16 = jnp.bfloat16
VALIDATED = _common.triton_release() in _common.GLUON_VALIDATED_TRITON


def sm90_candidates(m, n, k, dtype=BF16, out_dtype=None, cc=90):
    return [c for c in mm.configs_for(m, n, k, dtype, out_dtype, cc) if isinstance(c, mm.Sm90Config)]


def test_candidates_only_where_the_kernels_apply():
    if not VALIDATED:  # a Triton release the kernels were not run on: the Pallas candidates alone
        assert sm90_candidates(4096, 4096, 4096) == []
        assert _matmul_sm90.unsupported(4096, 4096, 4096, BF16, BF16, 90).startswith("Triton ")
        return
    assert sm90_candidates(4096, 4096, 4096) == list(_matmul_sm90.CONFIGS)
    assert mm.configs_for(4096, 4096, 4096, BF16, None, 90)[0] == _matmul_sm90.CONFIGS[0]  # fastest first
    assert sm90_candidates(1000, 1992, 520, jnp.float16) == list(
        _matmul_sm90.CONFIGS
    )  # edge tiles: TMA clips
    assert sm90_candidates(4096, 4096, 4096, out_dtype=F32) == []  # a wider result: the Pallas kernels
    assert sm90_candidates(4096, 4096, 4096, F32) == []
    assert sm90_candidates(4096, 4096, 4096, jnp.float8_e4m3fn, F32) == []
    assert sm90_candidates(64, 100, 64) == [] and sm90_candidates(64, 64, 100) == []  # rows not 16-byte
    assert sm90_candidates(4096, 4096, 4096, cc=80) == [] and sm90_candidates(4096, 4096, 4096, cc=None) == []
    assert "multiples of 8" in _matmul_sm90.unsupported(64, 100, 64, BF16, BF16, 90)


@pytest.mark.parametrize("config", _matmul_sm90.CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("shape", [(512, 768, 1024), (1000, 1992, 520)], ids=str)
def test_compiles_within_the_h200s_limits(config, shape):
    # Every Triton of pallas-gpu's range compiles it (Gluon's renamed functions are looked up by
    # name), though matmul tunes over it only on the releases it was run on.
    m, n, k = shape
    cfg = _matmul_sm90.kernel_config("bfloat16", m, n, k, config)
    assert cfg.function == f"matmul_{config.kind}"
    assert cfg.block_dims == (384, 1, 1)  # 2 math warpgroups + the producer warp's (padded) warpgroup
    assert 0 < cfg.shared_memory_bytes <= SHARED_MEMORY_LIMITS[90]
    assert cfg.global_scratch_bytes > 0  # the TMA descriptors made on the device


def test_grid_is_one_program_per_multiprocessor(monkeypatch):
    monkeypatch.setattr(_matmul_sm90, "multiprocessor_count", lambda: 132)
    coop = _matmul_sm90.Sm90Config("coop", 128, 256, 64, 3)
    assert _matmul_sm90.grid_size(8192, 8192, coop) == 132
    assert _matmul_sm90.grid_size(1000, 1992, coop) == 8 * 8  # ceil(1000 / 128) * ceil(1992 / 256)


@pytest.mark.skipif(
    not VALIDATED, reason="the Gluon matmul is taken only on the Triton releases it was run on"
)
def test_lowers_for_sm90_on_any_machine(monkeypatch):
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")  # compile for the H200 from a CPU machine
    x = jax.ShapeDtypeStruct((512, 512), BF16)
    xb = jax.ShapeDtypeStruct((3, 512, 512), BF16)
    for f, args in (
        (jax.jit(lambda a, b: mm.matmul(a, b)), (x, x)),
        (jax.jit(jax.vmap(lambda a, b: mm.matmul(a, b), in_axes=(0, None))), (xb, x)),
        (jax.jit(jax.vmap(lambda a, b: mm.matmul(a, b))), (xb, xb)),
    ):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @jax_kernel_runtime_launch" in text
        if not has_gpu():  # on a GPU the autotuner times every candidate, Pallas kernels too
            assert 'name = "matmul_coop"' in text  # with no GPU the first candidate is taken


def test_sm90_config_errors():
    a = jnp.ones((64, 64), BF16)
    coop = _matmul_sm90.CONFIGS[0]
    with pytest.raises(
        ValueError, match=r"config=sm90-coop/128x256x64/3buf is a Hopper Gluon kernel.*interpret"
    ):
        mm.matmul(a, a, config=coop, interpret=True)
    if not has_gpu():
        with pytest.raises(ValueError, match="compute capability None, not 90; pass a MatmulConfig"):
            mm.matmul(a, a, config=coop)


@pytest.mark.parametrize(
    "config,match",
    [
        (dict(kind="split"), r"kind 'split': expected one of \('coop', 'pingpong'\)"),
        (dict(kind="coop", block_m=64), "block_m 64: coop takes 128"),
        (dict(kind="pingpong", block_m=256), "block_m 256: pingpong takes 64 or 128"),
        (dict(block_n=96), "block_n 96: expected 64, 128 or 256"),
        (dict(block_k=32), "block_k 32: expected 64 or 128"),
        (dict(kind="pingpong", block_m=128, block_n=256), "128x256 f32 accumulator per math warpgroup"),
        (dict(num_buffers=1), "num_buffers 1 and group_m 8: expected >= 2"),
    ],
)
def test_sm90_config_shape_errors(config, match):
    bad = _matmul_sm90.Sm90Config(**config)
    a = jnp.ones((256, 256), BF16)
    with pytest.raises(ValueError, match=r"pallas_gpu\.ops\.matmul: config=Sm90Config\(.*" + match):
        _matmul_sm90.matmul(a, a, bad)
    with pytest.raises(ValueError, match=match):
        _matmul_sm90.kernel_config("bfloat16", 256, 256, 256, bad)


def test_sm90_config_shared_memory_error():
    too_deep = _matmul_sm90.Sm90Config("coop", 128, 256, 64, 5)  # 5 x 48 KiB of ring + 64 KiB of C tiles
    with pytest.raises(
        ValueError, match=r"needs \d+ bytes of shared memory, more than sm_90 allows \(232448\)"
    ):
        _matmul_sm90.kernel_config("bfloat16", 1024, 1024, 1024, too_deep)


def hopper_gpu() -> bool:
    return has_gpu() and _common.compute_capability() == 90


NEEDS_HOPPER = pytest.mark.skipif(
    not (VALIDATED and hopper_gpu()),
    reason="needs an sm_90 GPU (H100/H200) and a Triton release the Gluon kernels were run on",
)


def check(out, a, b):
    ref = jnp.dot(a.astype(F32), b.astype(F32), precision="highest")
    assert out.dtype == a.dtype and out.shape == ref.shape
    err = float(jnp.max(jnp.abs(out.astype(F32) - ref)))
    assert err <= 1e-2 * float(jnp.max(jnp.abs(ref))), err


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("config", _matmul_sm90.CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize(
    "m,k,n,dtype",
    [
        (2048, 1024, 4096, BF16),  # 64 or 512 tiles: fewer and more than the programs
        (1000, 520, 1992, BF16),  # edge tiles in m, n and k (TMA zero-fills the loads, clips the stores)
        (4096, 4096, 4096, jnp.float16),
        (8, 64, 8, BF16),  # one tile, mostly outside the arrays
    ],
)
def test_each_config_on_gpu(config, m, k, n, dtype):
    a = jax.random.normal(fresh_key(), (m, k), F32).astype(dtype)
    b = jax.random.normal(fresh_key(), (k, n), F32).astype(dtype)
    check(jax.jit(lambda a, b: mm.matmul(a, b, config=config))(a, b), a, b)


@pytest.mark.gpu
@NEEDS_HOPPER
def test_autotuned_vmap_on_gpu():
    a = jax.random.normal(fresh_key(), (3, 256, 512), F32).astype(BF16)
    b = jax.random.normal(fresh_key(), (3, 512, 384), F32).astype(BF16)
    out = jax.jit(jax.vmap(lambda a, b: mm.matmul(a, b, config=_matmul_sm90.CONFIGS[0])))(a, b)
    for i in range(3):
        check(out[i], a[i], b[i])
    rows = jax.jit(jax.vmap(lambda a: mm.matmul(a, b[0])))(a)  # b unbatched: one product of stacked rows
    for i in range(3):
        check(rows[i], a[i], b[0])
