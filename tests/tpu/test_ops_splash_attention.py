"""``pallas_tpu.ops.splash_attention``: the kernels on fresh random data against a plain ``jnp``
attention over the dense mask (``jax.vjp`` of it for the gradients) and against JAX's op of the
same name (``jax.experimental.pallas.ops.tpu.splash_attention``, in JAX's interpret mode), run
every way of an op (tests/ways' ``every_way(op=True)``: TPU interpret mode, our Mosaic
lowering executed by ``run_mosaic``, and compiled by libtpu for the compile-only chips first). The masks and
their block schedules are in test_ops_splash_attention_mask.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way
from ways.compiled import chip_mesh

import pallas_tpu as pltpu
from pallas_tpu._src.mosaic import compile_check
from pallas_tpu.ops import _policy
from pallas_tpu.ops import splash_attention as sa
from pallas_tpu.ops.splash_attention import _blocks as sb
from pallas_tpu.ops.splash_attention import splash_attention_kernel as sk

needs_libtpu = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)

jax.config.update("jax_enable_checks", True)

F32, BF16 = jnp.float32, jnp.bfloat16


def rand(seed, shape, dtype=F32):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def segments(seed, length, pieces=3):
    """Sorted ids: ``pieces`` runs of random lengths (a packed sequence)."""
    return jnp.sort(jax.random.randint(jax.random.key(seed), (length,), 0, pieces)).astype(jnp.int32)


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err <= tol, f"max |error| / max(1, max |want|) = {err:.3g} > {tol}"


def dense_attention(mask, q, k, v, seg=None, sinks=None, soft_cap=None):
    """softmax(masked q k^T) v in float32 ``jnp``, heads grouped onto k/v heads (MQA: k 2-d)."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    heads = q.shape[0]
    if k.ndim == 2:
        k, v = jnp.broadcast_to(k, (heads, *k.shape)), jnp.broadcast_to(v, (heads, *v.shape))
    else:
        k, v = jnp.repeat(k, heads // k.shape[0], axis=0), jnp.repeat(v, heads // v.shape[0], axis=0)
    s = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest")
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    keep = jnp.asarray(mask)
    if seg is not None:
        keep = keep & (seg.q[:, None] == seg.kv[None, :])[None]
    s = jnp.where(keep, s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks.astype(F32)[:, None, None], (*s.shape[:2], 1))], -1)
    p = jax.nn.softmax(s, axis=-1)[..., : k.shape[1]]
    return jnp.einsum("hqk,hkd->hqd", p, v, precision="highest")


@dataclasses.dataclass(frozen=True)
class Case:
    mask: str = "causal"
    heads: int = 2
    kv_heads: int | None = None  # None: as many as q heads; 0: MQA
    q_len: int = 256
    kv_len: int = 256
    head_dim: int = 128
    head_dim_v: int | None = None  # None: head_dim
    dtype: object = F32
    blocks: tuple | None = (128, 128, 128)  # (block_q, block_kv, block_kv_compute); None: chosen
    segments: bool = False
    sinks: bool = False
    soft_cap: float | None = None
    grads: bool = True
    tol: float = 3e-3
    # the most scores of a pattern run as straight-line cells (``_common.STRAIGHT_LINE_SCORES``, both kernels);
    # 0: every pattern shares code and loops (a causal diagonal's patterns one body)
    straight_line: int | None = None
    loop_scores: int | None = None  # the scores a loop iteration takes (``_common.LOOP_SCORES``)
    fused: bool = False  # BlockSizes.use_fused_bwd_kernel: dq in the dk/dv kernel


def make_mask(name, heads, q_len, kv_len):
    shape = (q_len, kv_len)
    per_head = {
        "causal": lambda h: sa.CausalMask(shape),
        "causal_offset": lambda h: sa.CausalMask(shape, offset=kv_len - q_len),
        "local": lambda h: sa.LocalMask(shape, (96, 40), 0),
        "chunked": lambda h: sa.ChunkedCausalMask(shape, 128),
        "full": lambda h: sa.FullMask(shape),
        # materialized partial blocks, a different mask per head
        "random": lambda h: sa.NumpyMask(sa.make_random_mask(shape, 0.7, h) | sa.make_causal_mask(shape)),
        "causal_or_local": lambda h: (
            sa.CausalMask(shape) & (sa.LocalMask(shape, (64, None), 0) | sa.FullMask(shape))
        ),
    }[name]
    return sa.MultiHeadMask([per_head(h) for h in range(heads)])


def inputs(c: Case):
    kv_heads = c.heads if c.kv_heads is None else c.kv_heads
    kv_shape = (c.kv_len, c.head_dim) if kv_heads == 0 else (kv_heads, c.kv_len, c.head_dim)
    dv = c.head_dim if c.head_dim_v is None else c.head_dim_v
    q = rand(1, (c.heads, c.q_len, c.head_dim), c.dtype)
    k, v = rand(2, kv_shape, c.dtype), rand(3, (*kv_shape[:-1], dv), c.dtype)
    do = rand(4, (c.heads, c.q_len, dv), c.dtype)
    sinks = rand(5, (c.heads,)) if c.sinks else None
    seg = sa.SegmentIds(segments(6, c.q_len), segments(6, c.kv_len)) if c.segments else None
    return q, k, v, do, sinks, seg


def splash(c: Case, mask, interpret=False):
    make = sa.make_splash_mqa_single_device if c.kv_heads == 0 else sa.make_splash_mha_single_device
    blocks = None if c.blocks is None else sa.BlockSizes(*c.blocks, use_fused_bwd_kernel=c.fused)
    return make(mask, block_sizes=blocks, attn_logits_soft_cap=c.soft_cap, interpret=interpret)


def with_grads(f, q, k, v, do, sinks):
    if sinks is None:
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None), q, k, v)
    else:
        out, vjp = jax.vjp(f, q, k, v, sinks)
    return (out, *vjp(do))


CASES = {
    "causal_f32": Case(),
    "causal_bf16_chosen_blocks": Case(dtype=BF16, q_len=512, kv_len=512, blocks=None, grads=False, tol=3e-2),
    "causal_offset_two_chunks": Case("causal_offset", q_len=256, kv_len=512, blocks=(128, 256, 128)),
    # cells of 256 queries by 256 keys: the diagonal's empty cell skipped, its full one unmasked
    "causal_banded_cells": Case(q_len=512, kv_len=512, blocks=(512, 512, 256), grads=False),
    "local_gqa_segments": Case("local", heads=4, kv_heads=2, segments=True, blocks=(128, 256, 128)),
    "random_per_head_mqa": Case("random", heads=2, kv_heads=0),
    "chunked_soft_cap_sinks": Case("chunked", soft_cap=4.0, sinks=True, tol=4e-3),
    "combined_bf16": Case("causal_or_local", dtype=BF16, head_dim=64, tol=4e-2),
    # the backward kernels in cells of half their 512 blocks (the diagonal's empty cell skipped)
    "causal_backward_cells": Case(q_len=512, kv_len=512, blocks=(512, 512, 256, 512, 512, 256, 512, 512)),
    # v's head dimension narrower than q's and k's, grouped kv heads
    "gqa_narrow_v": Case("causal", heads=2, kv_heads=1, head_dim_v=64, blocks=(128, 128, 128)),
    # a kernel made without blocks, called with head_dim 256: its blocks chosen for that width
    "wide_heads_chosen_blocks": Case(
        "causal_offset", heads=1, q_len=256, kv_len=4096, head_dim=256, blocks=None
    ),
    # patterns too large to unroll (forced): the diagonal's four places one body, loops of alike chunks
    "causal_loops": Case(
        q_len=512, kv_len=512, blocks=(128, 512, 128, 128, 512, 128, 128, 512), straight_line=0
    ),
    "local_loops_segments": Case(
        "local", q_len=512, kv_len=512, segments=True, blocks=(256, 512, 128), straight_line=0
    ),
    # two chunks a loop iteration: the diagonal's leading chunks (0, 2, 4 or 6) in one loop of pairs
    "causal_loops_pairs": Case(
        heads=1, q_len=1024, kv_len=1024, blocks=(256, 1024, 128), straight_line=0, loop_scores=2**16
    ),
    # the fused backward kernel (dq accumulated per head in the dk/dv kernel): query offsets
    # inside a block (cells of 256), in a loop, grouped and shared kv heads, a soft cap
    "causal_backward_cells_fused": Case(
        q_len=512, kv_len=512, blocks=(512, 512, 256, 512, 512, 256), fused=True
    ),
    "causal_loops_fused": Case(
        q_len=512, kv_len=512, blocks=(128, 512, 128, 128, 512, 128), straight_line=0, fused=True
    ),
    "local_gqa_segments_fused": Case(
        "local", heads=4, kv_heads=2, segments=True, blocks=(128, 256, 128), fused=True
    ),
    "random_per_head_mqa_fused": Case("random", heads=2, kv_heads=0, fused=True),
    "chunked_soft_cap_sinks_fused": Case("chunked", soft_cap=4.0, sinks=True, tol=4e-3, fused=True),
    # five alike chunks, two an iteration: the fifth after the loop
    "full_loops_odd": Case(
        "full", q_len=256, kv_len=640, blocks=(128, 640, 128), straight_line=0, loop_scores=2**15
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@every_way(op=True)
def test_ways(way, case, monkeypatch):
    c = CASES[case]
    if c.straight_line is not None:
        from pallas_tpu.ops.splash_attention import _common

        monkeypatch.setitem(_common.STRAIGHT_LINE_SCORES, "fwd", c.straight_line)
        monkeypatch.setitem(_common.STRAIGHT_LINE_SCORES, "bwd", c.straight_line)
        if c.loop_scores is not None:
            monkeypatch.setattr(_common, "LOOP_SCORES", c.loop_scores)
    q, k, v, do, sinks, seg = inputs(c)
    mask = make_mask(c.mask, c.heads, c.q_len, c.kv_len)

    def op(q, k, v, do, *rest, interpret=False):
        kernel = splash(c, mask, interpret)

        def f(q, k, v, sinks):
            return kernel(q, k, v, seg, sinks)

        sink = rest[0] if rest else None
        return with_grads(f, q, k, v, do, sink) if c.grads else f(q, k, v, sink)

    args = (q, k, v, do) + ((sinks,) if c.sinks else ())
    outs = way.op(op, *args)

    def ref(q, k, v, sinks):
        return dense_attention(mask[:, :, :], q, k, v, seg, sinks, c.soft_cap)

    to32 = [x.astype(F32) for x in (q, k, v, do)]
    want = with_grads(ref, *to32, sinks) if c.grads else ref(*to32[:3], sinks)
    for got, exp in zip(outs if c.grads else [outs], want if c.grads else [want]):
        close(got, exp, way.dot_tol(c.tol, c.dtype, grads=c.grads))


def test_batched_with_vmap():
    """A batch through ``jax.vmap`` of the kernel (JAX's way to batch splash attention)."""
    c = Case("local", blocks=(128, 128, 128))
    mask = make_mask(c.mask, 2, 256, 256)
    kernel = splash(c, mask, interpret=pltpu.InterpretParams())
    q, k, v = rand(1, (2, 2, 256, 128)), rand(2, (2, 2, 256, 128)), rand(3, (2, 2, 256, 128))
    got = jax.vmap(kernel)(q, k, v)
    for b in range(2):
        close(got[b], dense_attention(mask[:, :, :], q[b], k[b], v[b]), 2e-3)


def test_save_residuals_and_references():
    """``save_residuals``: the logsumexp beside the output; JAX's reference builders agree."""
    mask = make_mask("random", 2, 256, 256)
    q, k, v = rand(1, (2, 256, 128)), rand(2, (2, 256, 128)), rand(3, (2, 256, 128))
    kernel = sa.make_splash_mha_single_device(
        mask, block_sizes=sa.BlockSizes(128, 128), save_residuals=True, interpret=True
    )
    out, (lse,) = kernel(q, k, v)
    want, (want_lse,) = sa.make_masked_mha_reference(mask)(q, k, v, save_residuals=True)
    close(out, want, 2e-3)
    close(lse, want_lse, 1e-4)
    close(want, dense_attention(mask[:, :, :], q, k, v), 1e-5)
    with pytest.raises(NotImplementedError, match="save_residuals=True is not differentiable"):
        jax.grad(lambda q: kernel(q, k, v)[0].sum())(q)


def test_many_patterns():
    """More distinct chunk patterns than a kernel has bodies for: the rare ones run all-PARTIAL."""
    from test_ops_splash_attention_mask import chunky_mask

    dense = chunky_mask(24, 4)[None]
    q, k, v = rand(1, (1, 24 * 128, 128)), rand(2, (1, 512, 128)), rand(3, (1, 512, 128))
    kernel = sa.make_splash_mha_single_device(dense, block_sizes=sa.BlockSizes(128, 512, 128), interpret=True)
    close(kernel(q, k, v), dense_attention(dense, q, k, v), 2e-3)


def test_whole_q_block_hidden_gives_zeros():
    """A q block the mask hides entirely is written (zeros), not left as it was in memory."""
    mask = np.ones((1, 256, 256), bool)
    mask[0, :128] = False
    q, k, v = rand(1, (1, 256, 128)), rand(2, (1, 256, 128)), rand(3, (1, 256, 128))
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 128), interpret=True)
    out = kernel(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[0, :128]), 0.0)
    close(out[0, 128:], dense_attention(mask, q, k, v)[0, 128:], 2e-3)


# ---------------------------------------------------------------------------------------------
# Against JAX's op (JAX's interpret mode).


@pytest.mark.parametrize("name", ["causal_segments", "local_mqa_soft_cap"])
def test_matches_jax_op(name):
    jsa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    heads, length = 2, 256
    q, k, v, do = (rand(i, (heads, length, 128)) for i in range(4))
    seg_ids = segments(9, length)
    if name == "local_mqa_soft_cap":
        k, v = k[0], v[0]

    def run(module):
        shape = (length, length)
        if name == "causal_segments":
            mask = module.MultiHeadMask([module.CausalMask(shape)] * heads)
            make, kw, seg = module.make_splash_mha_single_device, {}, module.SegmentIds(seg_ids, seg_ids)
        else:
            mask = module.MultiHeadMask([module.LocalMask(shape, (100, 20), 0)] * heads)
            make, kw, seg = module.make_splash_mqa_single_device, dict(attn_logits_soft_cap=3.0), None
        blocks = module.BlockSizes(
            block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
            block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128,
        )  # fmt: skip
        kernel = make(mask, block_sizes=blocks, interpret=True, **kw)
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, seg), q, k, v)
        return (out, *vjp(do))

    ours = run(sa)
    with jax.enable_checks(False):  # JAX's interpret mode's callbacks inside its custom_vjp
        theirs = run(jsa)
    for a, b in zip(ours, theirs):
        close(a, b, 2e-4)


def test_public_names_match_jax():
    jsa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    missing = sorted(n for n in dir(jsa) if not n.startswith("_") and not hasattr(sa, n))
    missing = [n for n in missing if not isinstance(getattr(jsa, n), type(jax))]  # submodules
    assert not missing, missing
    jsk = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")
    assert [f.name for f in dataclasses.fields(jsk.BlockSizes)] == [
        f.name for f in dataclasses.fields(sa.BlockSizes)
    ]
    assert sa.SegmentIds._fields == jsk.SegmentIds._fields
    for name in ("DEFAULT_MASK_VALUE", "NUM_LANES", "NUM_SUBLANES", "NT_DIM_NUMBERS", "NN_DIM_NUMBERS"):
        assert getattr(sk, name) == getattr(jsk, name), name
    assert [m.name for m in sa.QKVLayout] == [m.name for m in jsk.QKVLayout]


@needs_libtpu  # the blocks are checked by libtpu's compile for each chip
@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_default_blocks_fit_each_chip(chip):
    with chip_mesh(chip):
        b = sa.BlockSizes.get_default(8192, 8192)
        small = sa.BlockSizes.get_default(384, 640)
    assert b.has_backward_blocks and 8192 % b.block_q == 0 and b.block_kv % b.block_kv_compute == 0
    large = chip in ("v5e", "v6e", "v5p")
    assert (b.block_q, b.block_kv, b.block_kv_compute) == (
        (1024, 2048, 512) if large else (512, 2048, 512)
    ), b
    assert (small.block_q, small.block_kv) == (384, 640), small
    assert sa.BlockSizes.get_default().block_q % 128 == 0  # JAX's no-argument call


@needs_libtpu  # the blocks are checked by libtpu's compile for each chip
@pytest.mark.parametrize("chip", ["v5e", "v4"])
def test_default_blocks_follow_head_dim_and_dtype(chip):
    """Wider heads: proportionally fewer keys per forward block than at head_dim 128 on a chip
    of 4096 (the work and the straight-line code of a step alike), at most FORWARD_KEYS (2048: the
    first call's compile) and at least 512; narrower ones: as 128; VMEM bounds them."""
    with chip_mesh(chip):
        narrow = sa.BlockSizes.get_default(8192, 8192)
        by_dim = {d: sa.BlockSizes.get_default(8192, 8192, head_dim=d) for d in (64, 128, 256, 512)}
        f32 = sa.BlockSizes.get_default(8192, 8192, head_dim=256, dtype=F32)
        huge = sa.BlockSizes.get_default(8192, 8192, head_dim=2048, dtype=F32)
        budget = _policy.vmem_budget("attention")
    assert by_dim[64] == by_dim[128] == narrow
    base = 4096 if chip == "v5e" else 2048  # the keys at head_dim 128 before the cap
    for d, keys in ((256, base // 2), (512, base // 4)):
        assert by_dim[d].block_kv == min(sb.FORWARD_KEYS, max(512, keys)), (d, by_dim[d])
        assert by_dim[d].block_q == narrow.block_q
    assert f32 == by_dim[256]  # VMEM holds the 4-byte blocks as well
    assert sb._forward_vmem(huge.block_q, huge.block_kv, 2048, 4) <= budget, huge
    assert huge.block_kv <= 512, huge


def test_kernel_made_without_blocks_takes_its_calls_head_dim():
    mask = make_mask("causal_offset", 1, 256, 4096)
    kernel = sa.make_splash_mha_single_device(mask, interpret=True)
    narrow, wide = jnp.zeros((1, 256, 128)), jnp.zeros((1, 256, 512))
    assert kernel._for(narrow) is kernel
    chosen = kernel._for(wide)
    want = sa.BlockSizes.get_default(256, 4096, head_dim=512)
    assert want.use_fused_bwd_kernel and chosen.kwargs["fused_bwd"]  # the default: one backward kernel
    want = sb._complete(want)  # as kept: the dq blocks (for a dq too large to fuse) from dk/dv's
    assert chosen.kwargs["block_sizes"] == want and want != kernel.kwargs["block_sizes"]
    assert kernel._for(wide) is chosen  # made once
    given = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 512), interpret=True)
    assert given._for(wide) is given  # blocks given: kept


def test_kernel_remade_inside_a_trace_holds_no_tracer():
    """The kernel a call remakes for its head dim is made while that call is traced: its mask
    information must be concrete, or a later trace (a second jit, an export) gets the first's
    values (found by compile_check: "Too many leaves for PyTreeDef")."""
    mask = make_mask("causal_offset", 1, 256, 4096)
    kernel = sa.make_splash_mha_single_device(mask, interpret=True)
    wide = jnp.zeros((1, 256, 512))  # other blocks than head_dim 128's
    jax.make_jaxpr(kernel._for)(wide)  # remade inside this trace
    chosen = kernel._for(wide)
    assert chosen is not kernel
    leaves = jax.tree_util.tree_leaves(chosen)
    assert leaves and not any(isinstance(x, jax.core.Tracer) for x in leaves)


# ---------------------------------------------------------------------------------------------
# Errors name the argument.


def _kernel(**kw):
    mask = sa.MultiHeadMask([sa.CausalMask((256, 256))] * 2)
    kw.setdefault("block_sizes", sa.BlockSizes(128, 128))
    return sa.make_splash_mha_single_device(mask, interpret=True, **kw)


Q = jnp.zeros((2, 256, 128))
BAD_CALLS = {
    "jax array mask": (lambda: sa.make_splash_mha_single_device(jnp.ones((1, 256, 256), bool)), NotImplementedError, "jax.Array"),
    "mask type": (lambda: sa.make_splash_mha_single_device(sa.CausalMask((256, 256))), TypeError, "MultiHeadMask"),
    "mask rank": (lambda: sa.make_splash_mha_single_device(np.ones((256, 256), bool)), ValueError, "must be 3-d"),
    "mask dtype": (lambda: sa.make_splash_mha_single_device(np.ones((1, 256, 256), np.int32)), ValueError, "must be boolean"),
    "block_sizes type": (lambda: _kernel(block_sizes=(128, 128)), TypeError, "block_sizes must be a BlockSizes"),
    "soft cap": (lambda: _kernel(attn_logits_soft_cap=0.0), ValueError, "attn_logits_soft_cap must be positive"),
    "block_q": (
        lambda: sa.make_splash_mha_single_device(np.ones((1, 384, 256), bool), block_sizes=sa.BlockSizes(256, 128)),
        ValueError, r"block_sizes.block_q=256 must divide q_seq_len=384",
    ),
    "block lanes": (
        lambda: sa.make_splash_mha_single_device(np.ones((1, 256, 256), bool), block_sizes=sa.BlockSizes(128, 64)),
        ValueError, "multiple of 128",
    ),
    "head shards": (
        lambda: sa.make_splash_mha(np.ones((3, 256, 256), bool), head_shards=2, q_seq_shards=1),
        ValueError, "head_shards=2 must divide",
    ),
    "q rank": (lambda: _kernel()(Q[0], Q, Q), ValueError, "q must be"),
    "k rank": (lambda: _kernel()(Q, Q[0], Q[0]), ValueError, "k must be"),
    "k v shapes": (lambda: _kernel()(Q, Q, Q[:1]), ValueError, "k and v must have one shape but for the head dimension"),
    "kv heads": (lambda: _kernel()(Q, jnp.zeros((3, 256, 128)), jnp.zeros((3, 256, 128))), ValueError, "kv heads"),
    "head_dim": (lambda: _kernel()(Q, Q[..., :64], Q[..., :64]), ValueError, "head_dim of q"),
    "int q": (lambda: _kernel()(Q.astype(jnp.int32), Q, Q), TypeError, "q must be a floating-point array, got dtype int32"),
    "int v": (lambda: _kernel()(Q, Q, Q.astype(jnp.int8)), TypeError, "v must be a floating-point array, got dtype int8"),
    "segment dtype": (
        lambda: _kernel()(Q, Q, Q, sa.SegmentIds(jnp.zeros((256,), jnp.complex64), jnp.zeros((256,), jnp.int32))),
        TypeError, "segment_ids.q must be an integer",
    ),
    "segment tuple of lists": (lambda: _kernel()(Q, Q, Q, ([0] * 256, [0] * 256)), TypeError, "segment_ids must be a SegmentIds, got tuple"),
    "mask heads": (
        lambda: sa.make_splash_mha_single_device(
            sa.MultiHeadMask([sa.CausalMask((256, 256)), sa.FullMask((256, 256))]), block_sizes=sa.BlockSizes(128, 128)
        )(jnp.zeros((4, 256, 128)), Q[:1], Q[:1]),
        ValueError, "q has 4 heads, the kernel's mask 2",
    ),
    "block_q below a lane tile": (
        lambda: _kernel(block_sizes=sa.BlockSizes(64, 128)), ValueError, "block_q=64 must be a multiple of 128 .* lane-dense",
    ),
    "empty mask": (lambda: sa.make_splash_mha_single_device(np.ones((1, 0, 0), bool)), ValueError, "at least one head, query and key"),
    "q length": (lambda: _kernel()(Q[:, :128], Q, Q), ValueError, "do not fit the kernel's mask"),
    "segment ids": (
        lambda: _kernel()(Q, Q, Q, sa.SegmentIds(jnp.zeros((128,), jnp.int32), jnp.zeros((256,), jnp.int32))),
        ValueError, "segment_ids must be",
    ),
    "segment type": (lambda: _kernel()(Q, Q, Q, (Q, Q)), TypeError, "segment_ids must be a SegmentIds"),
    "sinks": (lambda: _kernel()(Q, Q, Q, None, jnp.zeros((3,))), ValueError, "sinks must be"),
    "mqa k": (
        lambda: sa.make_splash_mqa_single_device(np.ones((2, 256, 256), bool), block_sizes=sa.BlockSizes(128, 128))(Q, Q, Q),
        ValueError, "an MQA kernel",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments(case):
    call, error, words = BAD_CALLS[case]
    with pytest.raises(error, match=words):
        call()


def test_block_sizes_check_themselves():
    with pytest.raises(ValueError, match="block_kv_compute=384 must divide BlockSizes.block_kv=512"):
        sa.BlockSizes(block_q=128, block_kv=512, block_kv_compute=384)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        sa.BlockSizes(block_q=0, block_kv=128)
    with pytest.raises(ValueError, match="not needed with a fused kernel"):
        sa.BlockSizes(block_q=128, block_kv=128, block_q_dq=128, use_fused_bwd_kernel=True)
    assert not sa.BlockSizes(128, 128).has_backward_blocks


# ---------------------------------------------------------------------------------------------
# Sharded over heads and the q sequence (shard_map, 4 CPU devices).


@pytest.mark.parametrize("per_head", [False, True], ids=["shared_mask", "mask_per_head"])
def test_shard_map_heads_and_q_sequence(per_head):
    from ways.chip import needs_devices

    if jax.device_count() < 4:
        pytest.skip(needs_devices(4).kwargs["reason"])
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    heads, length = 4, 256
    shape = (length, length)
    masks = (
        [sa.CausalMask(shape), sa.LocalMask(shape, (100, 0), 0)] * 2
        if per_head
        else [sa.CausalMask(shape)] * 4
    )
    mask = sa.MultiHeadMask(masks)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("heads", "q"))
    kernel = sa.make_splash_mha(
        mask,
        block_sizes=sa.BlockSizes(128, 128),
        head_shards=2,
        q_seq_shards=2,
        interpret=pltpu.InterpretParams(),
    )
    spec = kernel.manual_sharding_spec(NamedSharding(mesh, P("heads", "q")))
    q, k, v, do = (rand(i, (heads, length, 128)) for i in range(4))

    def attend(kernel, q, k, v):
        return kernel(q, k, v)

    sharded = jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(spec, P("heads", "q", None), P("heads", None, None), P("heads", None, None)),
        out_specs=P("heads", "q", None),
        check_vma=False,  # TPU interpret mode inside shard_map does not type varying axes
    )
    got = with_grads(lambda q, k, v, s: sharded(kernel, q, k, v), q, k, v, do, None)
    want = with_grads(lambda q, k, v, s: dense_attention(mask[:, :, :], q, k, v), q, k, v, do, None)
    for a, b in zip(got, want):
        close(a, b, 3e-3)
    # Called whole, the same kernel runs its q shards one after the other.
    close(kernel(q, k, v), want[0], 3e-3)


# ---------------------------------------------------------------------------------------------
# Accuracy against JAX's op (both in TPU interpret mode), on a float32 reference.


def _blocks128(module):
    return module.BlockSizes(
        block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
        block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128,
    )  # fmt: skip


ACCURACY = {
    # name: (mask, kv heads (0: MQA), segments, soft cap, dtype)
    "causal_bf16": ("causal", None, False, None, BF16),
    "local_gqa_segments_bf16": ("local", 1, True, None, BF16),
    "full_mqa_soft_cap_bf16": ("full", 0, False, 20.0, BF16),
    "causal_f32": ("causal", None, False, None, F32),
}


@pytest.mark.parametrize("scale", ["sharp", "soft"])
@pytest.mark.parametrize("name", list(ACCURACY))
def test_accuracy_matches_jax_op(name, scale):
    """Ours' error (max |error| over the reference's max |value|) at most 1.1x JAX's, or
    within 1e-4 of it, for the output and each gradient, at logit scale 1 (a sharp softmax:
    unscaled normal q, k) and head_dim**-0.5 (q scaled before the call)."""
    jsa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    mask_name, kv_heads, segmented, cap, dtype = ACCURACY[name]
    heads, length, d = 2, 512, 128  # 256 lets the output's own rounding hide an 8-bit p
    kv_shape = (length, d) if kv_heads == 0 else (kv_heads or heads, length, d)
    q = rand(11, (heads, length, d)) * (1.0 if scale == "sharp" else d**-0.5)
    q, k, v, do = (
        q.astype(dtype),
        rand(12, kv_shape, dtype),
        rand(13, kv_shape, dtype),
        rand(14, q.shape, dtype),
    )
    ids = segments(15, length) if segmented else None

    def run(module):
        shape = (length, length)
        one = {"causal": module.CausalMask(shape), "local": module.LocalMask(shape, (96, 40), 0)}.get(
            mask_name, module.FullMask(shape)
        )
        mask = module.MultiHeadMask([one] * heads)
        make = module.make_splash_mqa_single_device if kv_heads == 0 else module.make_splash_mha_single_device
        kernel = make(mask, block_sizes=_blocks128(module), attn_logits_soft_cap=cap, interpret=True)
        seg = None if ids is None else module.SegmentIds(ids, ids)
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, seg), q, k, v)
        return (out, *vjp(do)), mask

    ours, mask = run(sa)
    with jax.enable_checks(False):  # JAX's interpret mode's callbacks inside its custom_vjp
        theirs, _ = run(jsa)
    seg = None if ids is None else sa.SegmentIds(ids, ids)
    to32 = [x.astype(F32) for x in (q, k, v, do)]
    want = with_grads(lambda q, k, v, s: dense_attention(mask[:, :, :], q, k, v, seg, None, cap), *to32, None)

    def err(got, ref):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        return np.max(np.abs(got - ref)) / np.max(np.abs(ref))

    for what, a, b, w in zip(("out", "dq", "dk", "dv"), ours, theirs, want):
        e_ours, e_jax = err(a, w), err(b, w)
        print(f"{name} {scale} {what}: ours {e_ours:.3g}, JAX's {e_jax:.3g}")
        assert e_ours <= 1.1 * e_jax + 1e-4, f"{what}: ours {e_ours:.3g} > 1.1 x JAX's {e_jax:.3g} + 1e-4"


# ---------------------------------------------------------------------------------------------
# Edges.


def hidden_aware_attention(mask, q, k, v, seg=None):
    """``dense_attention`` where a query row that sees no key gives zeros (and no gradient)."""
    keep = jnp.asarray(mask)
    if seg is not None:
        keep = keep & (seg.q[:, None] == seg.kv[None, :])[None]
    q, k, v = (x.astype(F32) for x in (q, k, v))
    k, v = jnp.repeat(k, q.shape[0] // k.shape[0], 0), jnp.repeat(v, q.shape[0] // v.shape[0], 0)
    s = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest")
    p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
    out = jnp.einsum("hqk,hkd->hqd", p, v, precision="highest")
    return jnp.where(keep.any(-1)[..., None], out, 0.0)


HIDDEN = {
    "causal_offset_hides_all": lambda shape: sa.CausalMask(shape, offset=-300),
    "numpy_all_false": lambda shape: sa.NumpyMask(np.zeros(shape, bool)),
    "local_window_sees_nothing": lambda shape: sa.LocalMask(shape, (-8, 0), 0),
    "causal_offset_hides_some": lambda shape: sa.CausalMask(shape, offset=-100),
}


@pytest.mark.parametrize("name", list(HIDDEN))
def test_rows_that_see_nothing_give_zeros(name):
    """A query row the mask hides wholly gives zeros and passes no gradient, whether its block
    is skipped or computed (JAX's kernels give mean(v) there); the visible rows are right."""
    heads, length = 2, 256
    mask = sa.MultiHeadMask([HIDDEN[name]((length, length))] * heads)
    dense = np.asarray(mask[:, :, :])
    q, k, v, do = (rand(20 + i, (heads, length, 128)) for i in range(4))
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 128), interpret=True)
    got = with_grads(lambda q, k, v, s: kernel(q, k, v), q, k, v, do, None)
    want = with_grads(lambda q, k, v, s: hidden_aware_attention(dense, q, k, v), q, k, v, do, None)
    hidden = ~dense.any(-1)
    assert hidden.any()
    np.testing.assert_array_equal(np.asarray(got[0])[hidden], 0.0)
    np.testing.assert_array_equal(np.asarray(got[1])[hidden], 0.0)  # dq of hidden rows
    for a, b in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        close(a, b, 2e-3)
    residual = sa.make_splash_mha_single_device(
        mask, block_sizes=sa.BlockSizes(128, 128), save_residuals=True, interpret=True
    )
    _, (lse,) = residual(q, k, v)
    assert np.all(np.asarray(lse)[hidden] == np.inf)
    ref_out, (ref_lse,) = sa.make_masked_mha_reference(mask)(q, k, v, save_residuals=True)
    close(ref_out, want[0], 1e-5)
    assert np.all(np.asarray(ref_lse)[hidden] == np.inf)


def test_partly_hidden_rows_match_jax_op_where_it_is_defined():
    jsa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    heads, length = 2, 256
    q, k, v = (rand(30 + i, (heads, length, 128)) for i in range(3))

    def run(module):
        mask = module.MultiHeadMask([module.CausalMask((length, length), offset=-100)] * heads)
        return module.make_splash_mha_single_device(mask, block_sizes=_blocks128(module), interpret=True)(
            q, k, v
        )

    ours = run(sa)
    with jax.enable_checks(False):
        theirs = run(jsa)
    close(ours[:, 100:], theirs[:, 100:], 2e-4)


def test_float_segment_ids_are_compared_as_given():
    """1.5 and 1.7 are two segments (truncated to int they would be one)."""
    length = 256
    ids_q = jnp.where(jnp.arange(length) < 100, 1.5, 1.7).astype(F32)
    ids_kv = jnp.where(jnp.arange(length) % 3 == 0, 1.5, 1.7).astype(F32)
    seg = sa.SegmentIds(ids_q, ids_kv)
    mask = sa.MultiHeadMask([sa.FullMask((length, length))] * 2)
    q, k, v = (rand(40 + i, (2, length, 128)) for i in range(3))
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 128), interpret=True)
    got = kernel(q, k, v, seg)
    close(got, dense_attention(mask[:, :, :], q, k, v, seg), 2e-3)
    merged = dense_attention(mask[:, :, :], q, k, v)
    assert np.max(np.abs(np.asarray(got) - np.asarray(merged))) > 0.1


def test_one_mask_serves_any_head_count():
    """A mask whose heads are all one mask serves any number of heads (as JAX's)."""
    mask = sa.MultiHeadMask([sa.CausalMask((256, 256))] * 2)
    q, k, v = rand(50, (4, 256, 128)), rand(51, (2, 256, 128)), rand(52, (2, 256, 128))
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 128), interpret=True)
    close(kernel(q, k, v), dense_attention(np.tril(np.ones((1, 256, 256), bool)), q, k, v), 2e-3)


@pytest.mark.parametrize("length", [1, 136, 200, 256])
def test_default_blocks_fit_any_length(length):
    """BlockSizes.get_default() with no lengths (JAX's call), blocks longer than the sequence
    and no blocks at all run any length: the blocks shrink to it."""
    mask = np.tril(np.ones((1, length, length), bool))
    q, k, v, do = (rand(60 + i, (1, length, 128)) for i in range(4))
    want = with_grads(lambda q, k, v, s: dense_attention(mask, q, k, v), q, k, v, do, None)
    for blocks in (sa.BlockSizes.get_default(), sa.BlockSizes(512, 1024, 512), None):
        kernel = sa.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=True)
        got = with_grads(lambda q, k, v, s: kernel(q, k, v), q, k, v, do, None)
        for a, b in zip(got, want):
            close(a, b, 3e-3)


def test_public_makers_have_no_private_parameters():
    import inspect

    for make in (
        sa.make_splash_mha,
        sa.make_splash_mqa,
        sa.make_splash_mha_single_device,
        sa.make_splash_mqa_single_device,
    ):
        names = list(inspect.signature(make).parameters)
        assert not [n for n in names if n.startswith("_")], names
