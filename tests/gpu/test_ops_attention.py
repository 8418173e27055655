"""pallas_gpu.ops.attention: ``mha`` forward and backward against
``mha_reference`` (plain JAX), through Triton's interpreter on the CPU (and
compiled for sm_80 and sm_90), or compiled and run on the GPU with
PALLAS_GPU_TESTS=gpu; the argument checks; the same API as JAX's
``jax.experimental.pallas.ops.gpu.attention``."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import ON_DEVICE, assert_close, check_all_compile, fresh_key, has_gpu, triton_mode

import pallas_gpu as plgpu
from pallas_gpu.ops import attention

SMALL = attention.BlockSizes(
    block_q=32, block_k=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
)
MIXED = attention.BlockSizes(
    block_q=64, block_k=32, block_q_dkv=32, block_kv_dkv=64, block_q_dq=64, block_kv_dq=32
)


def qkv(shape, dtype):
    return [jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype) for _ in range(4)]


def segments(batch, seq):
    """Three segments of uneven lengths per row, different per batch row."""
    cuts = np.sort(np.random.default_rng(batch * seq).integers(1, seq, size=(batch, 2)), axis=1)
    pos = np.arange(seq)[None, :]
    return jnp.asarray((pos >= cuts[:, :1]).astype(np.int32) + (pos >= cuts[:, 1:]).astype(np.int32))


def run_vjp(f, q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)


CASES = [
    # shape (batch, seq, heads, head_dim), dtype, causal, segment ids, blocks
    ((2, 128, 2, 32), jnp.float32, False, False, SMALL),
    ((2, 128, 2, 32), jnp.float32, True, False, MIXED),
    ((1, 128, 3, 64), jnp.float32, True, True, SMALL),
    ((2, 64, 2, 32), jnp.float32, False, True, MIXED),
    ((1, 128, 2, 64), jnp.bfloat16, True, False, SMALL),
    ((1, 64, 2, 16), jnp.bfloat16, False, True, SMALL),
]


@pytest.mark.parametrize("shape,dtype,causal,with_segments,blocks", CASES)
def test_mha_forward_and_backward(shape, dtype, causal, with_segments, blocks):
    q, k, v, do = qkv(shape, dtype)
    seg = segments(shape[0], shape[1]) if with_segments else None
    sm_scale = shape[-1] ** -0.5

    def f(q, k, v):
        return attention.mha(q, k, v, seg, sm_scale=sm_scale, causal=causal, block_sizes=blocks,
                             interpret=triton_mode())  # fmt: skip

    def ref(q, k, v):
        up = lambda a: a.astype(jnp.float32)  # noqa: E731
        return attention.mha_reference(up(q), up(k), up(v), seg, sm_scale=sm_scale, causal=causal)

    out, grads = run_vjp(f, q, k, v, do)
    ref_out, ref_grads = run_vjp(ref, q, k, v, do.astype(jnp.float32))
    tol = dict(rtol=5e-5, atol=5e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    if ON_DEVICE and dtype == jnp.float32:
        tol = dict(rtol=2e-2, atol=2e-2)  # the GPU's f32 dots run in TF32
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert_close(out.astype(jnp.float32), ref_out, **tol)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close(g.astype(jnp.float32), r, err_msg=f"d{name}", **tol)
    if not ON_DEVICE:
        n = check_all_compile(lambda q, k, v, do: run_vjp(f, q, k, v, do), [q, k, v, do],
                              plgpu.CompilerParams(num_warps=4, num_stages=2))  # fmt: skip
        assert n == 3  # forward, dk/dv, dq


@pytest.mark.skipif(not ON_DEVICE, reason="a GPU compile (pipelining) check; run with PALLAS_GPU_TESTS=gpu")
@pytest.mark.parametrize("num_stages", [2, 3])
def test_mha_backward_large_on_gpu(num_stages):
    # Long loops in the dk/dv kernel, where Triton's software pipelining
    # miscompiled dk (off by up to 0.05 on values up to 0.19); bf16 rounding
    # alone stays under 0.005 here.
    shape = (1, 1024, 4, 128)
    q, k, v, do = qkv(shape, jnp.bfloat16)
    blocks = attention.BlockSizes(128, 64, block_q_dkv=32, block_kv_dkv=128, block_q_dq=128, block_kv_dq=32)
    f = lambda q, k, v: attention.mha(q, k, v, None, sm_scale=128**-0.5, block_sizes=blocks,  # noqa: E731
                                      num_warps=8, num_stages=num_stages)  # fmt: skip
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref = lambda q, k, v: attention.mha_reference(up(q), up(k), up(v), None, sm_scale=128**-0.5)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        _, ref_grads = run_vjp(ref, q, k, v, up(do))
    _, grads = run_vjp(f, q, k, v, do)
    for name, g, r in zip("qkv", grads, ref_grads):
        scale = float(jnp.max(jnp.abs(r)))
        assert float(jnp.max(jnp.abs(up(g) - r))) < 0.02 * scale, f"d{name}"


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_mha_default_launches_on_gpu(causal):
    # The launches of the per-device table (block_sizes, num_warps and
    # num_stages left at None) at a size where every kernel loops many times.
    shape = (2, 2048, 4, 128)
    q, k, v, do = qkv(shape, jnp.bfloat16)
    f = lambda q, k, v: attention.mha(q, k, v, None, sm_scale=128**-0.5, causal=causal)  # noqa: E731
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref = lambda q, k, v: attention.mha_reference(
        up(q), up(k), up(v), None, sm_scale=128**-0.5, causal=causal
    )  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads = run_vjp(ref, q, k, v, up(do))
    out, grads = run_vjp(f, q, k, v, do)
    for name, g, r in zip(["out", "dq", "dk", "dv"], [out, *grads], [ref_out, *ref_grads]):
        scale = float(jnp.max(jnp.abs(r)))
        assert float(jnp.max(jnp.abs(up(g) - r))) < 0.02 * scale, name


def test_default_launches_come_from_the_table_or_the_fallback():
    measured = attention.default_launches(128, 90)
    assert set(measured) == {"fwd", "dkv", "dq"}
    assert measured == attention._MEASURED[90, 128]
    for d in (16, 64, 96, 128, 256):
        launches = attention.default_launches(d, None)  # no GPU: sized to head_dim
        assert all(bq >= 16 and bk >= 16 and w in (4, 8) for bq, bk, w, _ in launches.values())
    assert attention.default_launches(64, 80) == attention.default_launches(64, None)
    assert [attention.fit_block(128, s) for s in (4096, 96, 192, 64, 48)] == [128, 96, 64, 64, 48]


def test_dkv_pipelines_only_at_the_launches_measured_exact(monkeypatch):
    # Triton 3.6 miscompiled dk at 2-3 stages for some launches: only the measured default
    # launch pipelines; configured launches, other GPUs and interpret mode run one stage.
    monkeypatch.setattr(attention, "compute_capability", lambda: 90)
    q = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16)

    def dkv(**kw):
        args = dict(block_sizes=None, num_warps=None, num_stages=None, interpret=False)
        return attention._launches(q, q, **{**args, **kw}, causal=True, segment_ids=None)["dkv"]

    assert dkv() == attention._DKV_PIPELINED[90, 128] and dkv()[3] > 1
    assert dkv(num_stages=3)[3] == 1 and dkv(num_warps=4)[3] == 1
    assert dkv(block_sizes=attention.BlockSizes(64, 64, 64, 64, 64, 64))[3] == 1
    assert dkv(interpret=True)[3] == 1
    monkeypatch.setattr(attention, "compute_capability", lambda: 80)
    assert dkv()[3] == 1


def test_mha_default_arguments_fit_the_sequence():
    # block_sizes=None: the default blocks are halved until they divide the
    # sequence (192 = 3 * 64), where BlockSizes(128, ...) would raise.
    q, k, v, do = qkv((1, 192, 2, 32), jnp.float32)
    f = lambda q, k, v: attention.mha(q, k, v, None, sm_scale=0.3, causal=True, interpret=triton_mode())  # noqa: E731
    out, grads = run_vjp(f, q, k, v, do)
    ref_out, ref_grads = run_vjp(
        lambda q, k, v: attention.mha_reference(q, k, v, None, sm_scale=0.3, causal=True), q, k, v, do
    )
    tol = 2e-2 if ON_DEVICE else 5e-5  # the GPU's f32 dots run in TF32
    assert_close(out, ref_out, rtol=tol, atol=tol)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close(g, r, rtol=tol, atol=tol, err_msg=f"d{name}")


def test_return_residuals_gives_the_log_sum_exp():
    q, k, v, _ = qkv((2, 64, 2, 32), jnp.float32)
    out, lse = attention.mha(q, k, v, None, sm_scale=0.5, causal=True, block_sizes=SMALL,
                             interpret=triton_mode(), return_residuals=True)  # fmt: skip
    logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) * 0.5
    logits = jnp.where(jnp.tril(jnp.ones((64, 64), bool)), logits, -jnp.inf)
    tol = 2e-2 if ON_DEVICE else 2e-5  # the GPU's f32 dots run in TF32
    assert_close(lse, jax.nn.logsumexp(logits, axis=-1), rtol=tol, atol=tol)
    assert_close(out, attention.mha_reference(q, k, v, None, sm_scale=0.5, causal=True),
                 rtol=2e-2 if ON_DEVICE else 2e-5, atol=2e-2 if ON_DEVICE else 2e-5)  # fmt: skip


@pytest.mark.parametrize("sm_scale", [-0.4, 0.0])
def test_non_positive_sm_scale(sm_scale):
    """Unmasked blocks take the max of the raw logits and scale it afterwards,
    which is the scaled max only for sm_scale > 0; other scales keep the
    multiply first (causal and not: masked and unmasked blocks)."""
    q, k, v, _ = qkv((1, 128, 2, 32), jnp.float32)
    # Logits of hundreds (a max taken on the wrong side overflows exp2), exact in
    # TF32 (the GPU's f32 dots): q and k on a grid of quarters, q scaled by 20.
    q, k = jnp.round(q * 4) * 5, jnp.round(k * 4) / 4
    for causal in (False, True):
        out = attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal, block_sizes=SMALL,
                            interpret=triton_mode())  # fmt: skip
        # mha_reference (as JAX's) masks before scaling: -inf * sm_scale is not -inf here.
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) * sm_scale
        if causal:
            logits = jnp.where(jnp.tril(jnp.ones((128, 128), bool)), logits, -jnp.inf)
        ref = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits, axis=-1), v)
        tol = 2e-2 if ON_DEVICE else 2e-5
        assert_close(out, ref, rtol=tol, atol=tol, err_msg=f"causal={causal}")


def test_xla_backward_matches_triton_backward():
    q, k, v, do = qkv((1, 64, 2, 32), jnp.float32)
    grads = {}
    for impl in ("triton", "xla"):
        f = lambda q, k, v: attention.mha(q, k, v, None, causal=True, block_sizes=SMALL,  # noqa: E731
                                          backward_pass_impl=impl, interpret=triton_mode())  # fmt: skip
        grads[impl] = run_vjp(f, q, k, v, do)[1]
    for a, b in zip(grads["triton"], grads["xla"]):
        # On the GPU both run their f32 dots in TF32: the error scales with the gradients' size.
        atol = 1e-2 * float(jnp.max(jnp.abs(b))) if ON_DEVICE else 5e-5
        assert_close(a, b, rtol=2e-2 if ON_DEVICE else 5e-5, atol=atol)


def test_pallas_core_interpreter_runs_the_same_kernels():
    q, k, v, do = qkv((1, 64, 2, 32), jnp.float32)
    f = lambda q, k, v: attention.mha(q, k, v, None, causal=True, block_sizes=MIXED, interpret=True)  # noqa: E731
    out, grads = run_vjp(f, q, k, v, do)
    ref_out, ref_grads = run_vjp(
        lambda q, k, v: attention.mha_reference(q, k, v, None, causal=True), q, k, v, do
    )
    tol = 2e-2 if ON_DEVICE else 5e-5  # the GPU's f32 dots run in TF32
    assert_close(out, ref_out, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, rtol=tol, atol=tol)


def test_same_signature_as_jax():
    upstream = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention")
    for name in ("mha", "mha_reference", "segment_mask"):
        ours, theirs = getattr(attention, name), getattr(upstream, name)
        ours_params = list(inspect.signature(ours).parameters)
        assert ours_params == list(inspect.signature(theirs).parameters), name
    assert [f.name for f in __import__("dataclasses").fields(attention.BlockSizes)] == [
        f.name for f in __import__("dataclasses").fields(upstream.BlockSizes)
    ]
    assert attention.BlockSizes.get_default() == attention.BlockSizes(
        **vars_of(upstream.BlockSizes.get_default())
    )


def vars_of(dc):
    import dataclasses

    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)}


@pytest.mark.parametrize(
    "kwargs,shapes,error,match",
    [
        (dict(block_sizes=attention.BlockSizes(64, 32)), None, ValueError,
         r"seq_len 96 is not a multiple of BlockSizes.block_q=64"),
        (dict(block_sizes=attention.BlockSizes(8, 8)), None, ValueError, r"block_q=8 is below 16"),
        ({}, ((1, 96, 2, 32), (1, 96, 2, 16)), ValueError, r"same head_dim"),
        (dict(causal=True), ((1, 96, 2, 32), (1, 64, 2, 32)), ValueError, r"causal=True .* same seq_len"),
        (dict(grid=(1, 2, 3)), None, NotImplementedError, r"grid= is chosen"),
        (dict(backward_pass_impl="cuda"), None, ValueError, r"backward_pass_impl must be"),
        ({}, ((1, 96, 32), (1, 96, 32)), ValueError, r"must be \[batch, seq_len, num_heads, head_dim\]"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, shapes, error, match):
    q_shape, kv_shape = shapes or ((1, 96, 2, 32), (1, 96, 2, 32))
    q = jnp.zeros(q_shape, jnp.float32)
    k = v = jnp.zeros(kv_shape, jnp.float32)
    kwargs = {"block_sizes": attention.BlockSizes(32, 32), **kwargs}
    with pytest.raises(error, match=match):
        attention.mha(q, k, v, None, interpret=plgpu.InterpretParams(), **kwargs)


def test_bad_segment_ids_shape():
    q = jnp.zeros((2, 64, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"segment_ids must be \[batch, seq_len\] = \(2, 64\)"):
        attention.mha(
            q, q, q, jnp.zeros((2, 32), jnp.int32), block_sizes=SMALL, interpret=plgpu.InterpretParams()
        )
