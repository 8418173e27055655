"""pallas_gpu.ops.matmul against ``jnp.dot`` in f32 on random data: through
Triton's interpreter on the CPU (also compiled for sm_80 and sm_90), or on the
GPU with PALLAS_GPU_TESTS=gpu; edge tiles, a padded k, each config; the
argument checks; ``gpu``-marked tests at the benchmark's sizes, autotuned."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import ON_DEVICE, check_all_compile, fresh_key, triton_mode

import pallas_gpu as plgpu
from pallas_gpu.ops import matmul as mm

F32 = jnp.float32
# On the GPU, f32 dots run in TF32 (JAX's default precision there) and Hopper's fp8 tensor
# cores accumulate with fewer mantissa bits than f32: relative errors of ~1e-3 of the max.
F32_REL = 2e-3 if ON_DEVICE else 1e-5
FP8_REL = 2e-3 if ON_DEVICE else 1e-5


def operands(m, k, n, dtype):
    a = jax.random.normal(fresh_key(), (m, k), F32).astype(dtype)
    b = jax.random.normal(fresh_key(), (k, n), F32).astype(dtype)
    return a, b


def reference(a, b):
    return jnp.dot(a.astype(F32), b.astype(F32), precision="highest")


def check(out, a, b, rel):
    ref = reference(a, b)
    err = float(jnp.max(jnp.abs(out.astype(F32) - ref)))
    scale = float(jnp.max(jnp.abs(ref)))
    assert err <= rel * scale, (err, scale)


@pytest.mark.parametrize(
    "m,k,n,dtype",
    [
        (256, 128, 256, jnp.bfloat16),
        (200, 96, 176, jnp.bfloat16),  # edge tiles in m and n, k padded to whole blocks
        (130, 70, 40, F32),
        (64, 512, 96, jnp.float16),
    ],
)
def test_matmul_matches_jnp(m, k, n, dtype):
    a, b = operands(m, k, n, dtype)
    out = mm.matmul(a, b, preferred_element_type=F32, interpret=triton_mode())
    assert out.shape == (m, n) and out.dtype == F32
    check(out, a, b, F32_REL if dtype == F32 else 2e-3)
    out16 = mm.matmul(a, b, interpret=triton_mode())  # the inputs' dtype by default
    assert out16.dtype == dtype
    check(out16, a, b, F32_REL if dtype == F32 else 1e-2)


@pytest.mark.parametrize(
    "config", mm.CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}-tma{c.use_tma}-{c.label()}"
)
def test_every_candidate_config(config):
    # bf16 results: an f32 128x256 result tile staged for its TMA store would need 128 KiB
    # of shared memory beside the pipeline (more than sm_90 has: a clear error on the GPU).
    a, b = operands(256, 160, 512, jnp.bfloat16)
    out = mm.matmul(a, b, config=config, interpret=triton_mode())
    check(out, a, b, 1e-2)


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("sms", [3, 132])
def test_persistent_programs_walk_their_tiles(monkeypatch, sms, flatten):
    # 3 programs over 2 x 4 tiles: programs 0 and 1 take three tiles, program 2 takes two.
    monkeypatch.setattr(mm, "num_sms", lambda: sms)
    a, b = operands(256, 192, 512, jnp.bfloat16)
    config = mm.MatmulConfig(128, 128, 64, 2, 4, 3, True, persistent=True, flatten=flatten)
    assert config.fitted(256, 512, 192).persistent and not config.fitted(250, 512, 192).persistent
    out = mm.matmul(a, b, preferred_element_type=F32, config=config, interpret=triton_mode())
    check(out, a, b, 2e-3)


def test_fp8_inputs_accumulate_in_f32():
    a, b = operands(128, 128, 128, jnp.float8_e4m3fn)
    out = mm.matmul(a, b, preferred_element_type=F32, interpret=triton_mode())
    check(out, a, b, FP8_REL)  # fp8 products are exact in f32; only the summation differs


@pytest.mark.parametrize(
    "config",
    mm.FP8_CONFIGS,
    ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}-tma{c.use_tma}-p{c.persistent}",
)
def test_every_fp8_candidate_config(config):
    # b is read k-major (transposed by XLA first); k = 320 is padded to whole blocks.
    a, b = operands(256, 320, 512, jnp.float8_e4m3fn)
    assert config in mm.configs_for(256, 512, 320, jnp.float8_e4m3fn) or config.block_k > 320
    out = mm.matmul(a, b, preferred_element_type=jnp.bfloat16, config=config, interpret=triton_mode())
    check(out, a, b, 1e-2)


def test_fp8_edge_tiles():
    a, b = operands(200, 96, 176, jnp.float8_e5m2)  # masked fp8 loads (other=0.0)
    out = mm.matmul(a, b, preferred_element_type=F32, config=mm.FP8_CONFIGS[2], interpret=triton_mode())
    check(out, a, b, FP8_REL)


def test_candidates_compile_for_sm80_and_sm90():
    a, b = operands(512, 512, 512, jnp.bfloat16)
    configs = mm.configs_for(512, 512, 512)
    for c in [configs[0], next(c for c in configs if c.persistent)]:
        f = lambda a, b, c=c: mm.matmul(a, b, config=c)  # noqa: E731
        assert (
            check_all_compile(f, [a, b], plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages))
            == 1
        )


def test_configs_fit_small_problems():
    for c in mm.configs_for(40, 8, 24):  # m, n, k
        assert c.block_m == 64 and c.block_n == 16 and c.block_k == 32
    assert {c.block_k for c in mm.configs_for(4096, 4096, 4096, jnp.float8_e4m3fn)} == {64, 128}


@pytest.mark.parametrize(
    "args,exc,match",
    [
        (
            (jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))),
            ValueError,
            r"matmul: a must be a 2-d array, got shape \(2, 3, 4\)",
        ),
        ((jnp.zeros((3, 4)), jnp.zeros((5, 6))), ValueError, r"inner dimensions differ \(4 != 5\)"),
        ((jnp.zeros((3, 4)), jnp.zeros((4, 5), jnp.bfloat16)), TypeError, "a is float32 but b is bfloat16"),
        ((jnp.zeros((3, 4), jnp.int32), jnp.zeros((4, 5), jnp.int32)), TypeError, "a has dtype int32"),
    ],
)
def test_argument_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        mm.matmul(*args, interpret=True)


def test_fp8_result_dtype_error():
    a = jnp.zeros((16, 16), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="preferred_element_type float8_e4m3fn is not supported"):
        mm.matmul(a, a, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,k,n,dtype",
    [
        (4096, 4096, 4096, jnp.bfloat16),
        (8192, 1024, 8192, jnp.bfloat16),
        (2048, 2048, 2048, jnp.float8_e4m3fn),
    ],
)
def test_autotuned_matmul_on_gpu(m, k, n, dtype):
    a, b = operands(m, k, n, dtype)
    out = jax.jit(lambda a, b: mm.matmul(a, b, preferred_element_type=F32))(a, b)
    ref = reference(a, b)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(ref)))
    )


# The H200 table (ops/_matmul_table.py): a first call takes its pick instead of tuning.
_TABLE_DTYPES = {"16-bit": (jnp.bfloat16, jnp.bfloat16), "fp8": (jnp.float8_e4m3fn, F32)}


@pytest.mark.parametrize("row", mm._matmul_table.ROWS, ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}x{r[3]}")
def test_each_table_row_names_a_candidate_and_is_picked_at_its_shape(row):
    # a row whose config no candidate has any more (the candidates changed, the table did not)
    # would silently fall through to another row: rerun benchmarks/matmul_table.py then
    cls, m, n, k, label, _ = row
    dtype, out = _TABLE_DTYPES[cls]
    configs = mm.configs_for(m, n, k, dtype, out, 90)
    if label.startswith("sm90-") and not any(isinstance(c, mm.Sm90Config) for c in configs):
        # the Gluon kernels need the Triton they were written for (3.6): elsewhere a Pallas pick
        assert label in [c.label() for c in mm._matmul_sm90.CONFIGS]
        assert mm.table_config(m, n, k, dtype, out, configs) in configs
        return
    assert label in [c.label() for c in configs]
    assert mm.table_config(m, n, k, dtype, out, configs).label() == label


@pytest.mark.parametrize("shape", [(6144, 6144, 6144), (3000, 5000, 2000), (100, 8192, 8192), (64, 64, 64)])
@pytest.mark.parametrize("cls", ["16-bit", "fp8"])
def test_a_shape_not_in_the_table_takes_a_fitted_pick_of_its_class(shape, cls):
    dtype, out = _TABLE_DTYPES[cls]
    for cc in (90, 80):  # on sm_80 the Gluon picks are no candidates: another row's pick or the first
        configs = mm.configs_for(*shape, dtype, out, cc)
        picked = mm.table_config(*shape, dtype, out, configs)
        assert picked in configs
        picks = {
            c.label()
            for _, tm, tn, tk, label, _ in mm._matmul_table.ROWS
            for c in mm.configs_for(*shape, dtype, out, cc)
            if c.label() == label or getattr(c, "block_m", 0) and c == picked
        }
        assert picked.label() in picks | {configs[0].label()}


def test_the_nearest_row_wins():
    # in log2 distance 2600^3 is nearer 2048^3 than 4096^3, 3500^3 nearer 4096^3; the fp8 rows at
    # those sizes pick different Pallas configs (candidates with every Triton, unlike the Gluon ones)
    rows = {(r[1], r[2], r[3]): r[4] for r in mm._matmul_table.ROWS if r[0] == "fp8"}
    assert rows[2048, 2048, 2048] != rows[4096, 4096, 4096]
    f8 = jnp.float8_e4m3fn
    for size, nearest in [(2600, 2048), (3500, 4096)]:
        configs = mm.configs_for(size, size, size, f8, F32, 90)
        picked = mm.table_config(size, size, size, f8, F32, configs)
        base = next(
            c for c in mm.FP8_CONFIGS if c.fitted(nearest, nearest, nearest).label() == rows[(nearest,) * 3]
        )
        assert picked == base.fitted(size, size, size)


@pytest.mark.parametrize("dtype,out", [(F32, F32), (jnp.bfloat16, F32), (jnp.float16, F32)])
def test_dtypes_the_table_does_not_cover_are_tuned(dtype, out):
    configs = mm.configs_for(4096, 4096, 4096, dtype, out, 90)
    assert mm.table_config(4096, 4096, 4096, dtype, out, configs) is None


@pytest.mark.parametrize("value", ["yes", 1, None, "Background"])
def test_autotune_argument_error(value):
    a = jnp.zeros((16, 16), jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"pallas_gpu.ops.matmul: autotune must be False .* got " + repr(value)
    ):
        mm.matmul(a, a, autotune=value, interpret=True)


@pytest.mark.parametrize("autotune", [False, True, "background"])
def test_every_autotune_mode_computes_the_product(autotune):
    a, b = operands(96, 64, 80, jnp.bfloat16)
    check(mm.matmul(a, b, autotune=autotune, interpret=triton_mode()), a, b, 1e-2)


def test_background_tuning_records_its_winner():
    # plgpu.autotune's background mode, timed by a given timer (so on the CPU too): the
    # caller returns at once; the winner is recorded when the thread ends
    release = threading.Event()
    seen = []

    def timer(fn, args):
        release.wait(60)
        scale = round(float(fn(*args)) / float(jnp.sum(args[0])), 3)  # the data are random stand-ins
        seen.append(scale)
        return {2.0: 3e-3, 3.0: 1e-3, 5.0: 2e-3}[scale]

    tuned = plgpu.autotune(
        lambda x, *, scale: jnp.sum(x) * scale,
        configs=[dict(scale=2.0), dict(scale=3.0), dict(scale=5.0)],
        name=f"test_background_tuning_records_its_winner.{np.random.default_rng().integers(1 << 30)}",
        timer=timer,
    )
    x = jnp.ones((1,), F32)
    assert tuned.recorded_index(x) is None
    tuned.tune_in_background(x)
    tuned.tune_in_background(x)  # already running: no second tuning
    assert tuned.recorded_index(x) is None  # the timer holds it
    release.set()
    deadline = time.monotonic() + 60
    while tuned.recorded_index(x) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tuned.recorded_index(x) == 1
    assert sorted(seen) == [2.0, 3.0, 5.0]  # each config timed once
    assert float(tuned(x)) == 3.0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 6144, 6144), (3000, 5000, 2000)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_table_pick_and_background_tuning_on_gpu(shape, dtype):
    m, n, k = shape
    a, b = operands(m, k, n, dtype)
    out = jnp.bfloat16 if dtype == jnp.bfloat16 else F32
    check(mm.matmul(a, b, preferred_element_type=out), a, b, 1e-2)  # the table's pick, no tuning
    check(mm.matmul(a, b, preferred_element_type=out, autotune="background"), a, b, 1e-2)
    tuned = mm._tuned(mm.configs_for(m, n, k, dtype, out, mm.compute_capability()))
    kw = dict(out_dtype=jnp.dtype(out), interpret=False, debug=False)
    for thread in list(tuned._background.values()):
        thread.join()
    assert tuned.recorded_index(a, b, **kw) is not None
    check(mm.matmul(a, b, preferred_element_type=out), a, b, 1e-2)  # the winner now
