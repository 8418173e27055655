"""``mha``'s Hopper forward (the Gluon kernel of
``pallas_gpu.ops._attention_sm90_kernel``): which calls take it, that it
compiles for sm_90 on any machine (Triton's interpreter does not run Gluon),
and, on an sm_90 GPU, its output and log-sum-exp against plain JAX on fresh
random data, under ``jax.grad`` and ``jax.vmap``."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
import triton
from gpu_test_base import fresh_key, has_gpu

import pallas_gpu
from jax_kernel_runtime.triton import SHARED_MEMORY_LIMITS
from pallas_gpu.ops import _attention_sm90, _common, attention

VALIDATED = _common.triton_release() in _common.GLUON_VALIDATED_TRITON


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def applies(q=None, k=None, v=None, segment_ids=None, sm_scale=0.1, **kw):
    q = q if q is not None else spec((2, 1024, 4, 128))
    k = k if k is not None else q
    args = dict(block_sizes=None, num_warps=None, num_stages=None, interpret=False)
    return attention.sm90_forward_applies(
        q, k, v if v is not None else k, segment_ids, sm_scale, **{**args, **kw}
    )


def test_taken_only_at_the_default_arguments_on_hopper(monkeypatch):
    monkeypatch.setattr(attention, "compute_capability", lambda: 90)
    assert applies() is VALIDATED
    if not VALIDATED:  # a Triton release the kernel was not run on: the Pallas forward, with the reason
        x = spec((2, 1024, 4, 128))
        reason = _attention_sm90.unsupported(x, x, x, None, 0.1, 90)
        assert reason.startswith("Triton ")
        return
    assert applies(q=spec((1, 256, 2, 64), jnp.float16), k=spec((1, 512, 2, 64), jnp.float16))
    # Anything the kernel was not built for, or a launch the user chose, runs the Pallas forward.
    assert not applies(block_sizes=attention.BlockSizes(128, 128))
    assert not applies(num_warps=8) and not applies(num_stages=3)
    assert not applies(interpret=True)
    assert not applies(segment_ids=spec((2, 1024), jnp.int32))
    assert not applies(q=spec((2, 1024, 4, 128), jnp.float32))
    assert not applies(v=spec((2, 1024, 4, 128), jnp.float32))  # q and k bf16, v f32
    assert not applies(k=spec((2, 1024, 4, 128), jnp.float16))
    assert not applies(q=spec((2, 1024, 4, 96)))
    assert not applies(q=spec((2, 192, 4, 128)))
    assert not applies(q=spec((2, 256, 4, 128)), k=spec((2, 320, 4, 128)))
    assert not applies(sm_scale=0.0) and not applies(sm_scale=-0.5)
    monkeypatch.setattr(attention, "compute_capability", lambda: 80)
    assert not applies()
    monkeypatch.setattr(attention, "compute_capability", lambda: None)
    assert not applies()


def names_in_hlo(f, *avals) -> str:
    return f.trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_for_sm90_on_any_machine(monkeypatch, causal):
    # PALLAS_GPU_COMPUTE_CAPABILITY=90: compile for the H200 from a CPU machine.
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    x = spec((1, 256, 2, 128))
    fwd = jax.jit(lambda q, k, v: attention.mha(q, k, v, None, sm_scale=0.1, causal=causal))
    grad = jax.jit(
        jax.grad(
            lambda q, k, v: attention.mha(q, k, v, None, sm_scale=0.1, causal=causal).sum(), argnums=(0, 1, 2)
        )
    )
    batched = jax.jit(jax.vmap(lambda q, k, v: attention.mha(q, k, v, None, sm_scale=0.1, causal=causal)))
    xb = spec((3, 1, 256, 2, 128))
    want = "mha_forward_sm90" if VALIDATED else "mha_forward"
    for text in (names_in_hlo(fwd, x, x, x), names_in_hlo(grad, x, x, x), names_in_hlo(batched, xb, xb, xb)):
        assert want in text
    grad_text = names_in_hlo(grad, x, x, x)
    assert (
        "mha_backward_dkv" in grad_text and "mha_backward_dq" in grad_text
    )  # the backward is the Pallas one


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 64)])
def test_compiles_within_the_h200s_limits(dtype, head_dim):
    # Every Triton of pallas-gpu's range compiles it (Gluon's renamed functions are looked up by
    # name), though mha launches it only on the releases it was run on (_common.GLUON_VALIDATED_TRITON).
    for causal in (False, True):
        cfg = _attention_sm90.kernel_config(dtype, 2, 256, 512, 2, head_dim, causal)
        assert cfg.function == "mha_forward_sm90"
        assert cfg.block_dims == (384, 1, 1)  # 2 math warpgroups + the producer warp's (padded) warpgroup
        assert 0 < cfg.shared_memory_bytes <= SHARED_MEMORY_LIMITS[90]
        assert cfg.global_scratch_bytes > 0  # the TMA descriptors made on the device
        # The line table names the kernel's file relative to its sys.path entry: the image (and the
        # HLO holding it) does not depend on where pallas-gpu or Triton are installed.
        assert b"_attention_sm90_kernel.py" in cfg.image
        for package in (pallas_gpu, triton):
            assert os.path.dirname(os.path.abspath(package.__file__)).encode() not in cfg.image


def test_grid_is_persistent(monkeypatch):
    monkeypatch.setattr(_attention_sm90, "multiprocessor_count", lambda: 132)
    for causal in (False, True):
        assert _attention_sm90.grid_size(4096, causal=causal) == 132
        assert _attention_sm90.grid_size(100, causal=causal) == 100


@pytest.mark.parametrize(
    "heads,q_tiles,programs,want",
    [
        (128, 32, 132, 4),
        (512, 8, 132, 16),
        (6, 8, 132, 6),
        (15, 1, 132, 15),
        (7, 32, 132, 1),
        (128, 64, 132, 2),
    ],
)
def test_causal_tiles_are_grouped_by_about_one_wave(heads, q_tiles, programs, want):
    gh = _attention_sm90.head_group(heads, q_tiles, programs)
    assert gh == want
    assert heads % gh == 0 and (gh == 1 or gh * q_tiles <= programs)


def test_debug_says_which_forward_runs(monkeypatch, capsys):
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    x = spec((1, 256, 2, 64))
    names_in_hlo(jax.jit(lambda q, k, v: attention.mha(q, k, v, None, sm_scale=0.1, debug=True)), x, x, x)
    printed = capsys.readouterr().out
    if VALIDATED:
        assert "the sm_90 Gluon kernel mha_forward_sm90" in printed
    else:
        assert "The Triton kernel for pallas_call 'mha_forward'" in printed


def reference(q, k, v, sm_scale, causal):
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    logits = jnp.einsum("bqhc,bkhc->bhqk", up(q), up(k), precision="highest") * sm_scale
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits, axis=-1), up(v), precision="highest")
    return out, lse


def hopper_gpu() -> bool:
    return has_gpu() and attention.compute_capability() == 90


NEEDS_HOPPER = pytest.mark.skipif(
    not (VALIDATED and hopper_gpu()),
    reason="needs an sm_90 GPU (H100/H200) and a Triton release the Gluon kernel was run on",
)


@pytest.mark.parametrize(
    "dtype,shape_q,seq_k,causal",
    [
        (jnp.bfloat16, (2, 1024, 3, 128), 1024, True),
        # Queries and keys of different lengths; 256 non-causal tiles over 132 persistent programs.
        (jnp.bfloat16, (2, 512, 32, 128), 1536, False),
        (jnp.float16, (1, 2048, 2, 64), 2048, True),
        (jnp.float16, (1, 4096, 16, 64), 4096, False),  # 512 tiles: 3-4 per program
        (jnp.bfloat16, (1, 4096, 16, 128), 4096, True),  # causal: 512 tiles in groups of 4 heads, snake order
        (jnp.bfloat16, (2, 3072, 7, 64), 3072, True),  # 14 (batch, head) pairs of 24 tiles: groups of 2
        (jnp.float16, (2, 1024, 2, 128), 1024, False),  # fewer tiles than programs
        (jnp.bfloat16, (3, 128, 5, 64), 128, True),  # one block: the diagonal only
    ],
)
@pytest.mark.gpu
@NEEDS_HOPPER
def test_output_and_lse_on_gpu(dtype, shape_q, seq_k, causal):
    B, T, H, D = shape_q
    q = jax.random.normal(fresh_key(), shape_q, jnp.float32).astype(dtype)
    k, v = (jax.random.normal(fresh_key(), (B, seq_k, H, D), jnp.float32).astype(dtype) for _ in range(2))
    sm_scale = D**-0.5
    assert applies(q=q, k=k, v=v, sm_scale=sm_scale)
    out, lse = attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal, return_residuals=True)
    ref_out, ref_lse = reference(q, k, v, sm_scale, causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (B, H, T)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out)))
    assert err < 1e-2 * max(1.0, float(jnp.max(jnp.abs(ref_out)))), err
    assert float(jnp.max(jnp.abs(lse - ref_lse))) < 1e-2


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("causal", [False, True])
def test_vmap_and_grad_on_gpu(causal):
    shape = (2, 1, 512, 2, 128)  # a vmapped axis of 2 over [batch 1, 512, 2 heads, 128]
    q, k, v, do = (jax.random.normal(fresh_key(), shape, jnp.float32).astype(jnp.bfloat16) for _ in range(4))
    sm_scale = 128**-0.5

    def loss(f):
        return lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    ours = lambda q, k, v: attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal)  # noqa: E731
    theirs = lambda q, k, v: reference(q, k, v, sm_scale, causal)[0]  # noqa: E731
    out = jax.vmap(ours)(q, k, v)
    ref = jax.vmap(theirs)(q, k, v)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) < 2e-2
    grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, ref_grads):
        scale = float(jnp.max(jnp.abs(r)))
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) < 2e-2 * scale, f"d{name}"
