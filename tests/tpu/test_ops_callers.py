"""How public projects that run on TPUs call JAX's Pallas TPU ops, each call pattern written once
as a function of an ops namespace (``JAX``: ``jax.experimental.pallas.ops.tpu``; ``OURS``:
``pallas_tpu.ops``) so that the only difference between the two runs is the import.

The patterns, written here from the ops' public APIs:

* a model-training framework (MaxText-like): splash attention made with ``make_splash_mha``
  (``MultiHeadMask``, ``head_shards=1``, ``q_seq_shards=1``, every ``BlockSizes`` field) and batched
  with ``jax.vmap``; segment ids, a logits soft cap, ``LocalMask`` sliding windows,
  ``ChunkedCausalMask``, the fused backward kernel; megablox ``gmm`` with its VJP (``tgmm``),
  ``group_offset`` and ``existing_out``;
* a serving engine (vLLM-TPU-like): ``paged_attention`` decode, ``ragged_paged_attention`` over
  mixed prefill and decode (sliding window, soft cap, chosen blocks),
  ``splash_attention.BlockSizes.get_default()``, causal ``flash_attention``;
* a second training framework: ``flash_attention`` with ``SegmentIds`` and every ``BlockSizes``
  field given, splash MQA (``make_splash_mqa_single_device``), ``save_residuals``, a
  mixture-of-experts layer of two grouped matmuls;
* a second serving engine: ``ragged_paged_attention.tuned_block_sizes`` (``get_tpu_version``,
  ``get_tuned_block_sizes``) choosing the ragged kernel's blocks.

Each pattern runs JAX's modules in JAX's TPU interpret mode and ours in ours, on the same fresh
random inputs: ours must give JAX's result (to a bf16 tolerance), and both a plain float32 ``jnp``
reference where one is cheap to write.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tpu as pltpu

pytest.importorskip("jax.experimental.pallas.ops.tpu")
from jax.experimental.pallas import tpu as jax_pltpu  # noqa: E402

jax.config.update("jax_enable_checks", True)

F32 = jnp.float32
BF16 = jnp.bfloat16

# Module paths, relative to each ops package, of what the callers import.
MODULES = {
    "flash_attention": "flash_attention",
    "splash_attention": "splash_attention",
    "splash_attention_kernel": "splash_attention.splash_attention_kernel",
    "splash_attention_mask": "splash_attention.splash_attention_mask",
    "megablox": "megablox",
    "paged_attention": "paged_attention",
    "ragged_paged_attention": "ragged_paged_attention",
    "tuned_block_sizes": "ragged_paged_attention.tuned_block_sizes",
}


def leaves(x):
    return jax.tree_util.tree_leaves(x)


def unrolled_vmap(f):
    """``jax.vmap(f)`` over axis 0 of every argument, as a loop over the batch: JAX's TPU interpret
    mode does not run a ``jax.vmap``ped kernel that has ``dimension_semantics`` (the batch's grid
    dimension is not among them: ``safe_zip`` of the grid and the semantics fails)."""

    def run(*args, **kwargs):
        batch = leaves((args, kwargs))[0].shape[0]
        take = [jax.tree.map(lambda x, b=b: x[b], (args, kwargs)) for b in range(batch)]
        outs = [f(*a, **kw) for a, kw in take]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return run


class Ops:
    """One ops package's modules by the names the callers use (``ops.splash_attention_kernel``);
    ``ops.vmap``: ``jax.vmap`` (a loop over the batch for JAX's modules, see ``unrolled_vmap``)."""

    def __init__(self, root, vmap=jax.vmap):
        self.root = root
        self.vmap = vmap

    def __getattr__(self, name):
        if name not in MODULES:
            raise AttributeError(name)
        return importlib.import_module(f"{self.root}.{MODULES[name]}")


JAX = Ops("jax.experimental.pallas.ops.tpu", vmap=unrolled_vmap)
OURS = Ops("pallas_tpu.ops")


def on_jax(pattern, *args):
    with jax.enable_checks(False), jax_pltpu.force_tpu_interpret_mode(jax_pltpu.InterpretParams()):
        return jax.block_until_ready(pattern(JAX, *args))


def on_ours(pattern, *args):
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        return jax.block_until_ready(pattern(OURS, *args))


def rand(seed, shape, dtype=F32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape, F32)).astype(dtype)


def close(got, want, tol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err <= tol, f"{what}: max |error| / max(1, max |want|) = {err:.3g} > {tol}"


def check(pattern, args, reference=None, tol=2e-2, ref_tol=3e-2, jax_runs=True):
    """Ours equals JAX's result (``tol``) and, given ``reference`` (a function of ``args``), both
    are within ``ref_tol`` of it. ``jax_runs=False``: JAX's op does not run in its TPU interpret
    mode on a CPU, so ours is held to the reference only."""
    ours = on_ours(pattern, *args)
    if not jax_runs:
        want = reference(*args)
        for i, (a, w) in enumerate(zip(leaves(ours), leaves(want), strict=True)):
            close(a, w, ref_tol, f"ours vs reference, output {i}")
        return ours
    theirs = on_jax(pattern, *args)
    assert len(leaves(ours)) == len(leaves(theirs))
    for i, (a, b) in enumerate(zip(leaves(ours), leaves(theirs))):
        assert a.dtype == b.dtype, (i, a.dtype, b.dtype)
        close(a, b, tol, f"ours vs JAX's, output {i}")
    if reference is not None:
        want = reference(*args)
        assert len(leaves(want)) == len(leaves(ours))
        for i, (a, b, w) in enumerate(zip(leaves(ours), leaves(theirs), leaves(want))):
            close(a, w, ref_tol, f"ours vs reference, output {i}")
            close(b, w, ref_tol, f"JAX's vs reference, output {i}")
    return ours


# ---------------------------------------------------------------------------------------------
# References (float32 jnp)


def causal(s_q, s_k):
    return np.arange(s_k)[None, :] <= np.arange(s_q)[:, None]


def dense_attention(q, k, v, keep, *, sm_scale=1.0, soft_cap=None, segment_ids=None, lse=False):
    """softmax(q k^T * sm_scale [soft-capped], masked by ``keep`` [.., Sq, Sk]) v, in float32;
    q ``[B, H, Sq, D]``, k/v ``[B, H or 1, Sk, D]``."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    s = jnp.einsum(
        "bhqd,bhkd->bhqk", q, jnp.broadcast_to(k, (*q.shape[:2], *k.shape[2:])), precision="highest"
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    keep = jnp.broadcast_to(jnp.asarray(keep), s.shape)
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids
        keep = keep & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum(
        "bhqk,bhkd->bhqd", p, jnp.broadcast_to(v, (*q.shape[:2], *v.shape[2:])), precision="highest"
    )
    return (out, jax.nn.logsumexp(s, axis=-1)) if lse else out


def attention_with_grads(f, q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


def reference_grads(keep, **kw):
    def ref(q, k, v, do):
        f32 = [x.astype(F32) for x in (q, k, v, do)]
        return attention_with_grads(lambda q, k, v: dense_attention(q, k, v, keep, **kw), *f32)

    return ref


def segments(seed, batch, length, pieces=3):
    """Sorted ids of a packed sequence: ``pieces`` runs of random lengths per batch row."""
    cuts = jax.random.randint(jax.random.key(seed), (batch, length), 0, pieces)
    return jnp.sort(cuts, axis=1).astype(jnp.int32)


def qkv(seed, batch, heads, seq, head_dim=128, dtype=BF16, kv_heads=None, q_scale=None):
    kv_heads = heads if kv_heads is None else kv_heads
    q = rand(seed, (batch, heads, seq, head_dim), F32, head_dim**-0.5 if q_scale is None else q_scale)
    k = rand(seed + 1, (batch, kv_heads, seq, head_dim))
    v = rand(seed + 2, (batch, kv_heads, seq, head_dim))
    do = rand(seed + 3, (batch, heads, seq, head_dim))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


# ---------------------------------------------------------------------------------------------
# A model-training framework (MaxText-like): splash attention


def splash_blocks(ops, block=128, fused=False):
    sk = ops.splash_attention_kernel
    if fused:
        return sk.BlockSizes(
            block_q=block,
            block_kv=block,
            block_kv_compute=block,
            block_q_dkv=block,
            block_kv_dkv=block,
            block_kv_dkv_compute=block,
            use_fused_bwd_kernel=True,
        )
    return sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )


def training_splash(make_mask, *, soft_cap=None, fused=False, grads=True, with_segments=False):
    """The trainer's splash call: a mask per head, ``make_splash_mha`` on one shard, the kernel
    ``jax.vmap``ped over the batch (segment ids as a keyword), under ``jax.jit``; the gradients
    through ``jax.vjp``."""

    def pattern(ops, q, k, v, do, *seg):
        sk, sm = ops.splash_attention_kernel, ops.splash_attention_mask
        heads, seq = q.shape[1], q.shape[2]
        mask = sm.MultiHeadMask([make_mask(sm, (seq, seq)) for _ in range(heads)])
        kernel = sk.make_splash_mha(
            mask=mask,
            head_shards=1,
            q_seq_shards=1,
            block_sizes=splash_blocks(ops, fused=fused),
            attn_logits_soft_cap=soft_cap,
        )

        def attend(q, k, v):
            if with_segments:
                return ops.vmap(kernel)(q, k, v, segment_ids=sk.SegmentIds(q=seg[0], kv=seg[0]))
            return ops.vmap(kernel)(q, k, v)

        if not grads:
            return jax.jit(attend)(q, k, v)
        return jax.jit(lambda q, k, v, do: attention_with_grads(attend, q, k, v, do))(q, k, v, do)

    return pattern


def test_training_splash_causal_vmap_grads():
    args = qkv(0, 2, 2, 256)
    pattern = training_splash(lambda sm, shape: sm.CausalMask(shape=shape))
    check(pattern, args, reference_grads(causal(256, 256)))


def test_training_splash_segment_ids():
    q, k, v, do = qkv(10, 2, 2, 256)
    seg = segments(14, 2, 256)
    pattern = training_splash(lambda sm, shape: sm.CausalMask(shape=shape), grads=False, with_segments=True)

    def reference(q, k, v, do, seg):
        return dense_attention(q, k, v, causal(256, 256), segment_ids=(seg, seg))

    check(pattern, (q, k, v, do, seg), reference)


def test_training_splash_soft_cap_grads():
    # unscaled queries: logits of standard deviation ~11, so a cap of 20 bends them
    args = qkv(20, 1, 2, 256, q_scale=1.0)
    pattern = training_splash(lambda sm, shape: sm.CausalMask(shape=shape), soft_cap=20.0)
    check(pattern, args, reference_grads(causal(256, 256), soft_cap=20.0))


def test_training_splash_sliding_window_grads():
    window = 100  # not a multiple of the blocks: partial blocks on both edges of the band

    def make_mask(sm, shape):
        return sm.CausalMask(shape=shape) & sm.LocalMask(shape=shape, window_size=(window, window), offset=0)

    i, j = np.arange(256)[:, None], np.arange(256)[None, :]
    args = qkv(30, 1, 2, 256)
    check(training_splash(make_mask), args, reference_grads((j <= i) & (j >= i - window)))


def test_training_splash_chunked_causal():
    chunk = 128
    args = qkv(40, 1, 2, 512)

    def make_mask(sm, shape):
        return sm.ChunkedCausalMask(shape=shape, chunk_size=chunk)

    i, j = np.arange(512)[:, None], np.arange(512)[None, :]
    keep = (j <= i) & (i // chunk == j // chunk)
    check(training_splash(make_mask, grads=False), args, lambda q, k, v, do: dense_attention(q, k, v, keep))


def test_training_splash_fused_backward():
    args = qkv(50, 1, 2, 256)
    pattern = training_splash(lambda sm, shape: sm.CausalMask(shape=shape), fused=True)
    check(pattern, args, reference_grads(causal(256, 256)))


# ---------------------------------------------------------------------------------------------
# Megablox grouped matmuls (the trainers' mixture-of-experts layers)


def gmm_reference(lhs, rhs, group_sizes, group_offset=0, dtype=F32):
    """Row r of ``lhs`` times ``rhs[group(r) - group_offset]`` where that group is local, else 0."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
    local = group - group_offset
    ok = (local >= 0) & (local < rhs.shape[0])
    w = rhs.astype(F32)[jnp.clip(local, 0, rhs.shape[0] - 1)]
    out = jnp.einsum("mk,mkn->mn", lhs.astype(F32), w, precision="highest")
    return jnp.where(ok[:, None], out, 0.0).astype(dtype)


GROUP_SIZES = jnp.array([128, 0, 200, 184], jnp.int32)  # an empty group, groups across tiles


def moe_operands(seed, m=512, k=256, n=256, groups=4, dtype=BF16):
    return rand(seed, (m, k), dtype), rand(seed + 1, (groups, k, n), dtype, 0.1)


def test_training_gmm_forward_bf16():
    lhs, rhs = moe_operands(60)

    def pattern(ops, lhs, rhs, group_sizes):
        m, k, n = lhs.shape[0], lhs.shape[1], rhs.shape[2]
        tiling = (min(128, m), min(128, k), min(128, n))
        return jax.jit(
            lambda lhs, rhs, gs: ops.megablox.gmm(
                lhs=lhs, rhs=rhs, group_sizes=gs, preferred_element_type=BF16, tiling=tiling
            )
        )(lhs, rhs, group_sizes)

    check(pattern, (lhs, rhs, GROUP_SIZES), gmm_reference)


def test_training_gmm_vjp_through_tgmm():
    lhs, rhs = moe_operands(70)
    d_out = rand(72, (512, 256), BF16)

    def pattern(ops, lhs, rhs, group_sizes, d_out):
        def f(lhs, rhs):
            return ops.megablox.gmm(
                lhs, rhs, group_sizes, preferred_element_type=BF16, tiling=(128, 128, 128)
            )

        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(d_out))

    def reference(lhs, rhs, group_sizes, d_out):
        f32 = [x.astype(F32) for x in (lhs, rhs, d_out)]
        out, vjp = jax.vjp(lambda a, b: gmm_reference(a, b, group_sizes), *f32[:2])
        return (out, *vjp(f32[2]))

    check(jax.jit(pattern, static_argnums=0), (lhs, rhs, GROUP_SIZES, d_out), reference, ref_tol=4e-2)


def test_training_gmm_group_offset():
    # the experts sharded two ways: this shard holds groups 2 and 3, the others' rows are 0
    lhs, rhs = moe_operands(80)
    local = rhs[2:]

    def pattern(ops, lhs, rhs, group_sizes):
        offset = jnp.array(2, jnp.int32)
        return ops.megablox.gmm(lhs, rhs, group_sizes, F32, (128, 128, 128), offset)

    check(pattern, (lhs, local, GROUP_SIZES), lambda a, b, gs: gmm_reference(a, b, gs, group_offset=2))


def test_training_gmm_existing_out_accumulates_shards():
    # shard by shard into one output: the second call writes its groups' rows into the first's
    lhs, rhs = moe_operands(90)

    def pattern(ops, lhs, rhs, group_sizes):
        gmm = ops.megablox.gmm
        first = gmm(lhs, rhs[:2], group_sizes, F32, (128, 128, 128), jnp.array(0, jnp.int32))
        return gmm(lhs, rhs[2:], group_sizes, F32, (128, 128, 128), jnp.array(2, jnp.int32), first)

    check(pattern, (lhs, rhs, GROUP_SIZES), gmm_reference)


def moe_layer(gmm, x, router, w_up, w_down, top_k=2):
    """A mixture-of-experts MLP: top-k routing, tokens sorted by expert, two grouped matmuls,
    unsorted and weighted back."""
    tokens, experts = x.shape[0], router.shape[1]
    logits = x.astype(F32) @ router
    weights, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    hidden = jax.nn.silu(gmm(rows, w_up, sizes))
    out_sorted = gmm(hidden.astype(x.dtype), w_down, sizes)
    out = jnp.zeros((tokens * top_k, x.shape[1]), F32).at[order].set(out_sorted.astype(F32))
    return jnp.einsum("tkd,tk->td", out.reshape(tokens, top_k, -1), weights)


def test_second_trainer_moe_layer_grads():
    x = rand(100, (256, 128), BF16)
    router = rand(101, (128, 4), F32)
    w_up, w_down = rand(102, (4, 128, 256), BF16, 0.1), rand(103, (4, 256, 128), BF16, 0.1)

    def pattern(ops, x, router, w_up, w_down):
        def gmm(lhs, rhs, sizes):
            return ops.megablox.gmm(lhs, rhs, sizes, preferred_element_type=F32, tiling=(128, 128, 128))

        loss = lambda *a: jnp.sum(moe_layer(gmm, *a) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))(x, router, w_up, w_down)

    def reference(x, router, w_up, w_down):
        def gmm(lhs, rhs, sizes):
            return gmm_reference(lhs.astype(F32), rhs.astype(F32), sizes)

        def loss(x, w_up, w_down):
            f32 = [a.astype(F32) for a in (x, w_up, w_down)]
            return jnp.sum(moe_layer(gmm, f32[0], router, *f32[1:]) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w_up, w_down)

    check(pattern, (x, router, w_up, w_down), reference, ref_tol=5e-2)


# ---------------------------------------------------------------------------------------------
# A serving engine (vLLM-TPU-like)


def paged_cache(seed, kv_heads, pages, page_size, head_dim, dtype=BF16):
    k = rand(seed, (kv_heads, pages, page_size, head_dim), dtype)
    v = rand(seed + 1, (kv_heads, pages, page_size, head_dim), dtype)
    return k, v


def paged_reference(q, k_pages, v_pages, lengths, page_indices, soft_cap=None):
    """Decode attention of each sequence's query over its first ``lengths[b]`` cached tokens."""
    batch, heads, d = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    outs = []
    for b in range(batch):
        k = k_pages[:, page_indices[b]].reshape(kv_heads, -1, d)
        v = v_pages[:, page_indices[b]].reshape(kv_heads, -1, d)
        k, v = (jnp.repeat(x, heads // kv_heads, axis=0)[None] for x in (k, v))
        keep = (np.arange(k.shape[2]) < int(lengths[b]))[None, None, None, :]
        outs.append(dense_attention(q[b][None, :, None], k, v, keep, soft_cap=soft_cap)[0, :, 0])
    return jnp.stack(outs)


def serving_paged_inputs(seed, batch=4, heads=4, kv_heads=2, page_size=16, pages_per_seq=8):
    pages = batch * pages_per_seq + 3
    q = rand(seed, (batch, heads, 128), BF16, 128**-0.5)
    k_pages, v_pages = paged_cache(seed + 1, kv_heads, pages, page_size, 128)
    perm = jax.random.permutation(jax.random.key(seed + 3), pages)[: batch * pages_per_seq]
    page_indices = perm.reshape(batch, pages_per_seq).astype(jnp.int32)
    lengths = jnp.array([37, 128, 5, 90][:batch], jnp.int32)
    return q, k_pages, v_pages, lengths, page_indices


def test_serving_paged_attention_decode():
    def pattern(ops, q, k_pages, v_pages, lengths, page_indices):
        return jax.jit(
            lambda *a: ops.paged_attention.paged_attention(*a, pages_per_compute_block=4, megacore_mode=None)
        )(q, k_pages, v_pages, lengths, page_indices)

    check(pattern, serving_paged_inputs(110), paged_reference)


def test_serving_paged_attention_megacore_batch_soft_cap():
    # Against the reference only: JAX's op with megacore_mode="batch" does not finish in JAX's TPU
    # interpret mode on a CPU (it waits forever).
    def pattern(ops, q, k_pages, v_pages, lengths, page_indices):
        return ops.paged_attention.paged_attention(
            q,
            k_pages,
            v_pages,
            lengths,
            page_indices,
            attn_logits_soft_cap=2.0,
            pages_per_compute_block=2,
            megacore_mode="batch",
        )

    check(
        pattern,
        serving_paged_inputs(120),
        lambda *a: paged_reference(*a, soft_cap=2.0),
        jax_runs=False,
    )


def ragged_inputs(seed, q_lens=(1, 5, 20), kv_lens=(40, 17, 60), q_heads=4, kv_heads=2, page_size=16):
    """A batch of one decode and two chunked-prefill sequences, padded as an engine pads it."""
    max_seqs, pages_per_seq, max_tokens = 4, 4, 32
    pages = max_seqs * pages_per_seq + 2
    q = rand(seed, (max_tokens, q_heads, 128), BF16)
    kv_pages = rand(seed + 1, (pages, page_size, 2 * kv_heads, 128), BF16)
    n = len(q_lens)
    kv = jnp.array(list(kv_lens) + [0] * (max_seqs - n), jnp.int32)
    cu = jnp.array(np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * (max_seqs - n)]), jnp.int32)
    perm = jax.random.permutation(jax.random.key(seed + 2), pages)[: max_seqs * pages_per_seq]
    page_indices = perm.reshape(max_seqs, pages_per_seq).astype(jnp.int32)
    return q, kv_pages, kv, page_indices, cu, jnp.array([n], jnp.int32)


def check_ragged(pattern, args, **kw):
    """Ours against JAX's ``ref_ragged_paged_attention`` (plain ``jnp``) only: JAX's kernel does not
    run in its TPU interpret mode on a CPU (it reshapes a Ref). Also our reference against JAX's."""
    total = int(args[4][int(args[5][0])])
    got = on_ours(pattern, *args)
    want = JAX.ragged_paged_attention.ref_ragged_paged_attention(*args, **kw)
    close(got[:total], want[:total], 3e-2, "ours vs JAX's reference")
    ours_ref = OURS.ragged_paged_attention.ref_ragged_paged_attention(*args, **kw)
    close(ours_ref[:total], want[:total], 1e-2, "our reference vs JAX's")


def test_serving_ragged_paged_attention_mixed_batch():
    sm_scale = 128**-0.5

    def pattern(ops, *args):
        return jax.jit(
            lambda *a: ops.ragged_paged_attention.ragged_paged_attention(
                *a, sm_scale=sm_scale, num_kv_pages_per_block=2, num_queries_per_block=16
            )
        )(*args)

    check_ragged(pattern, ragged_inputs(130), sm_scale=sm_scale)


def test_serving_ragged_paged_attention_sliding_window_soft_cap():
    kw = dict(sm_scale=128**-0.5, sliding_window=24, soft_cap=3.0)

    def pattern(ops, *args):
        return ops.ragged_paged_attention.ragged_paged_attention(
            *args, **kw, num_kv_pages_per_block=1, num_queries_per_block=8
        )

    check_ragged(pattern, ragged_inputs(140), **kw)


def block_fields(blocks):
    return {
        f.name: (int(x) if isinstance(x := getattr(blocks, f.name), (int, bool)) else x)
        for f in dataclasses.fields(blocks)
    }


@pytest.mark.xfail(
    strict=True,
    reason="ours' splash BlockSizes.get_default() with no arguments gives the chip's blocks "
    "(block_q 1024, block_kv_compute 512, ...), JAX's gives blocks of 128 on any chip",
)
def test_serving_splash_default_block_sizes_are_jax_s():
    # the engine reads the defaults' fields (to pad its sequences to block_q, say)
    assert block_fields(OURS.splash_attention.BlockSizes.get_default()) == block_fields(
        JAX.splash_attention.BlockSizes.get_default()
    )


def test_serving_splash_with_default_block_sizes():
    def pattern(ops, q, k, v, do):
        sa = ops.splash_attention
        seq = q.shape[2]
        mask = sa.MultiHeadMask([sa.CausalMask((seq, seq)) for _ in range(q.shape[1])])
        kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes.get_default())
        return jax.jit(ops.vmap(kernel))(q, k, v)

    check(pattern, qkv(150, 1, 2, 256), lambda q, k, v, do: dense_attention(q, k, v, causal(256, 256)))


def test_serving_flash_attention_causal_prefill():
    sm_scale = 128**-0.5

    def pattern(ops, q, k, v, do):
        return jax.jit(
            lambda q, k, v: ops.flash_attention.flash_attention(q, k, v, causal=True, sm_scale=sm_scale)
        )(q, k, v)

    check(
        pattern,
        qkv(160, 1, 2, 256, q_scale=1.0),
        lambda q, k, v, do: dense_attention(q, k, v, causal(256, 256), sm_scale=sm_scale),
    )


# ---------------------------------------------------------------------------------------------
# A second training framework: flash with segment ids and explicit blocks, splash MQA, residuals


def test_second_trainer_flash_segment_ids_explicit_blocks_grads():
    q, k, v, do = qkv(170, 2, 2, 256)
    seg = segments(175, 2, 256)

    def pattern(ops, q, k, v, do, seg):
        fa = ops.flash_attention
        blocks = fa.BlockSizes(
            block_q=128,
            block_k_major=128,
            block_k=128,
            block_b=1,
            block_q_major_dkv=128,
            block_k_major_dkv=128,
            block_k_dkv=128,
            block_q_dkv=128,
            block_k_major_dq=128,
            block_k_dq=128,
            block_q_dq=128,
        )
        ids = fa.SegmentIds(q=seg, kv=seg)

        def f(q, k, v):
            return fa.flash_attention(q, k, v, segment_ids=ids, causal=True, sm_scale=1.0, block_sizes=blocks)

        return jax.jit(lambda *a: attention_with_grads(f, *a))(q, k, v, do)

    def reference(q, k, v, do, seg):
        return reference_grads(causal(256, 256), segment_ids=(seg, seg))(q, k, v, do)

    check(pattern, (q, k, v, do, seg), reference)


def test_second_trainer_splash_mqa_vmap_grads():
    q, _, _, do = qkv(180, 2, 4, 256)
    k, v = rand(181, (2, 256, 128), BF16), rand(182, (2, 256, 128), BF16)

    def pattern(ops, q, k, v, do):
        sa = ops.splash_attention
        mask = sa.MultiHeadMask([sa.CausalMask((256, 256)) for _ in range(q.shape[1])])
        kernel = sa.make_splash_mqa_single_device(mask, block_sizes=splash_blocks(ops))
        return jax.jit(lambda *a: attention_with_grads(ops.vmap(kernel), *a))(q, k, v, do)

    def reference(q, k, v, do):
        f32 = [x.astype(F32) for x in (q, k, v, do)]
        return attention_with_grads(
            lambda q, k, v: dense_attention(q, k[:, None], v[:, None], causal(256, 256)), *f32
        )

    check(pattern, (q, k, v, do), reference)


def test_second_trainer_splash_save_residuals():
    q, k, v, _ = qkv(190, 2, 2, 256, dtype=F32)

    def pattern(ops, q, k, v):
        sa = ops.splash_attention
        i, j = np.arange(256)[:, None], np.arange(256)[None, :]
        mask = sa.MultiHeadMask([sa.NumpyMask((j <= i) & (j >= i - 64)), sa.CausalMask((256, 256))])
        kernel = sa.make_splash_mha_single_device(mask, block_sizes=splash_blocks(ops), save_residuals=True)
        out, (lse,) = jax.jit(ops.vmap(kernel))(q, k, v)
        return out, lse

    i, j = np.arange(256)[:, None], np.arange(256)[None, :]
    keep = np.stack([(j <= i) & (j >= i - 64), j <= i])[None]
    check(
        pattern, (q, k, v), lambda q, k, v: dense_attention(q, k, v, keep, lse=True), tol=2e-3, ref_tol=2e-3
    )


# ---------------------------------------------------------------------------------------------
# A second serving engine: the ragged kernel's tuned blocks


def test_second_engine_tuned_block_sizes_follow_the_host():
    # On a CPU host JAX's get_tpu_version is -1 and get_tuned_block_sizes raises
    # NotImplementedError (no TPU of generation 4 or later): ours answers the same here.
    jt, ot = JAX.tuned_block_sizes, OURS.tuned_block_sizes
    assert ot.get_tpu_version() == jt.get_tpu_version()
    assert ot.get_device_name() == jt.get_device_name()
    assert ot.get_device_name(8) == jt.get_device_name(8)
    for x in (1, 3, 16, 17, 100, 4096):
        assert ot.next_power_of_2(x) == jt.next_power_of_2(x)
    for max_len in (128, 2048, 8192, 131072):
        assert ot.get_min_page_size(max_len) == jt.get_min_page_size(max_len)
    key = (BF16, BF16, 8, 2, 128, 16, 512, 128)
    assert ot.simplify_key(key) == jt.simplify_key(key)
    try:
        want = jt.get_tuned_block_sizes(*key)
    except NotImplementedError:
        with pytest.raises(NotImplementedError):
            ot.get_tuned_block_sizes(*key)
    else:
        assert ot.get_tuned_block_sizes(*key) == want


def test_second_engine_ragged_with_tuned_or_fallback_blocks():
    args = ragged_inputs(200, q_lens=(3, 1, 28), kv_lens=(50, 64, 33))
    sm_scale = 128**-0.5

    def pattern(ops, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        tuned = ops.tuned_block_sizes
        page_size, pages_per_seq = kv_pages.shape[1], page_indices.shape[1]
        if tuned.get_tpu_version() >= 4:
            bkv, bq = tuned.get_tuned_block_sizes(
                q.dtype,
                kv_pages.dtype,
                q.shape[1],
                kv_pages.shape[2] // 2,
                q.shape[2],
                page_size,
                q.shape[0],
                pages_per_seq,
            )
        else:  # the engine's fallback off a TPU
            bkv, bq = min(pages_per_seq, 2), min(q.shape[0], 16)
        return ops.ragged_paged_attention.ragged_paged_attention(
            q,
            kv_pages,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            num_kv_pages_per_block=bkv,
            num_queries_per_block=bq,
        )

    check_ragged(pattern, args, sm_scale=sm_scale)
