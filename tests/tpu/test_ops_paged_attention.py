"""``pallas_tpu.ops.paged_attention`` against a float64 numpy reference on fresh random data and
against JAX's op of the same name (``jax.experimental.pallas.ops.tpu.paged_attention``, in JAX's
TPU interpret mode), run every way of an op (tests/ways.py's ``every_way(op=True)``: our TPU
interpret mode, our Mosaic lowering under ``run_mosaic``, and libtpu's compile for the
compile-only chips first)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way

import pallas_tpu as pltpu
from pallas_tpu.ops import paged_attention as pa_pkg
from pallas_tpu.ops.paged_attention import (
    _blocks,
    _kernel,
    paged_attention,
    paged_attention_kernel,
    quantization_utils,
    util,
)

jax.config.update("jax_enable_checks", True)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def inputs(seed, *, batch, q_heads, kv_heads, page_size, pages_per_seq, dtype, lengths):
    """q, k_pages, v_pages, lengths, page_indices (pages drawn without repeats from a larger cache)."""
    total = batch * pages_per_seq + 5
    q = (rand(seed, (batch, q_heads, 128)) * 128**-0.5).astype(dtype)  # scaled, as callers pass it
    k = rand(seed + 1, (kv_heads, total, page_size, 128), dtype)
    v = rand(seed + 2, (kv_heads, total, page_size, 128), dtype)
    perm = jax.random.permutation(jax.random.key(seed + 3), total)[: batch * pages_per_seq]
    return q, k, v, jnp.asarray(lengths, jnp.int32), perm.reshape(batch, pages_per_seq).astype(jnp.int32)


def reference(q, k, v, lengths, page_indices, soft_cap=None):
    """float64 numpy: each sequence's pages gathered, one query per q head, masked past its length."""
    if isinstance(k, quantization_utils.QuantizedTensor):
        k = np.asarray(k.weight, np.float64) * np.asarray(k.scales, np.float64) / quantization_utils.MAX_INT8
        v = np.asarray(v.weight, np.float64) * np.asarray(v.scales, np.float64) / quantization_utils.MAX_INT8
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_heads, d = q.shape
    kv_heads = k.shape[0]
    out = np.zeros_like(q)
    for b in range(batch):
        n = int(lengths[b])
        if n == 0:
            continue
        keys = k[:, np.asarray(page_indices[b])].reshape(kv_heads, -1, d)[:, :n]
        vals = v[:, np.asarray(page_indices[b])].reshape(kv_heads, -1, d)[:, :n]
        for h in range(q_heads):
            s = keys[h // (q_heads // kv_heads)] @ q[b, h]
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vals[h // (q_heads // kv_heads)]
    return out


def close(out, ref, tol):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol)


# (dtype, quantized, q heads, kv heads, page size, pages per sequence, lengths, keywords, tol)
CASES = {
    # Short blocks (3 pages, not dividing 8): full, short and single-page last blocks, a length
    # of 0 (zeros), the soft cap, the KV heads split over two cores.
    "f32_soft_cap_kv_head_split": (
        jnp.float32, False, 8, 2, 16, 8, [1, 70, 0, 128],
        dict(pages_per_compute_block=3, attn_logits_soft_cap=20.0, megacore_mode="kv_head"), 2e-5,
    ),
    # Blocks chosen by the op; 4 q heads per KV head (a group of 4 rows, 8 pages of 16 bf16 keys).
    "bf16_default_blocks": (jnp.bfloat16, False, 8, 2, 16, 8, [128, 33, 100, 7], dict(), 3e-2),
    # Blocks of 2 pages: sequences of 6 full blocks (the steady loop: copies issued two blocks
    # ahead), 5 full and a short one, none (an empty step between two others: the stream skips
    # it), and a full and a short one (the tail starts the next step's blocks).
    "bf16_stream_across_steps": (
        jnp.bfloat16, False, 4, 2, 16, 12, [192, 170, 0, 40], dict(pages_per_compute_block=2), 3e-2,
    ),
    # int8 pages and one scale per key, the batch split over two cores, 8 q heads per KV head.
    "int8_batch_split": (
        jnp.bfloat16, True, 8, 1, 32, 4, [128, 1, 45, 96],
        dict(pages_per_compute_block=2, megacore_mode="batch", inline_seq_dim=False), 3e-2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@every_way(op=True)
def test_paged_attention(way, case):
    dtype, quantized, qh, kh, ps, pps, lengths, kw, tol = CASES[case]
    q, k, v, lengths, pages = inputs(len(case), batch=4, q_heads=qh, kv_heads=kh, page_size=ps,
                                     pages_per_seq=pps, dtype=dtype, lengths=lengths)  # fmt: skip
    if quantized:
        k, v = quantization_utils.quantize_to_int8(k), quantization_utils.quantize_to_int8(v)
    out = way.op(paged_attention, q, k, v, lengths, pages, **kw)
    assert out.dtype == q.dtype
    close(
        out,
        reference(q, k, v, lengths, pages, kw.get("attn_logits_soft_cap")),
        way.dot_tol(tol, dtype),
    )


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "int8"])
def test_matches_jax_op(quantized):
    """JAX's op in JAX's TPU interpret mode and ours (our interpret mode) on the same inputs."""
    jax_pa = pytest.importorskip("jax.experimental.pallas.ops.tpu.paged_attention")
    from jax.experimental.pallas import tpu as jax_pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as jax_qu

    q, k, v, lengths, pages = inputs(7, batch=2, q_heads=4, kv_heads=2, page_size=16, pages_per_seq=4,
                                     dtype=jnp.bfloat16, lengths=[37, 64])  # fmt: skip
    kw = dict(pages_per_compute_block=2, attn_logits_soft_cap=10.0)
    ours_k, ours_v, their_k, their_v = k, v, k, v
    if quantized:
        ours_k, ours_v = quantization_utils.quantize_to_int8(k), quantization_utils.quantize_to_int8(v)
        their_k, their_v = jax_qu.QuantizedTensor(*ours_k), jax_qu.QuantizedTensor(*ours_v)
    with jax.enable_checks(False), jax_pltpu.force_tpu_interpret_mode():
        theirs = jax_pa.paged_attention(q, their_k, their_v, lengths, pages, **kw)
    ours = paged_attention(q, ours_k, ours_v, lengths, pages, interpret=pltpu.InterpretParams(), **kw)
    close(ours, np.asarray(theirs, np.float64), 3e-2)
    close(ours, reference(q, ours_k, ours_v, lengths, pages, 10.0), 3e-2)


def test_reference_helpers_match_jax():
    """``util.grouped_query_attention_reference`` and ``quantization_utils`` give JAX's values."""
    jax_util = pytest.importorskip("jax.experimental.pallas.ops.tpu.paged_attention.util")
    from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as jax_qu

    q, k, v = rand(20, (2, 4, 128)), rand(21, (2, 2, 64, 128)), rand(22, (2, 2, 64, 128))
    lengths = jnp.array([10, 64], jnp.int32)
    ours = util.grouped_query_attention_reference(q, k, v, lengths, soft_cap=5.0)
    np.testing.assert_allclose(
        ours, jax_util.grouped_query_attention_reference(q, k, v, lengths, 5.0), atol=1e-5
    )
    ours_q, their_q = quantization_utils.quantize_to_int8(k), jax_qu.quantize_to_int8(k)
    np.testing.assert_array_equal(ours_q.weight, their_q.weight)
    np.testing.assert_array_equal(ours_q.scales, their_q.scales)
    np.testing.assert_allclose(
        quantization_utils.unquantize_from_int8(ours_q, jnp.float32),
        jax_qu.unquantize_from_int8(their_q, jnp.float32),
        rtol=1e-6,
    )
    assert pa_pkg.paged_attention is paged_attention


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_choose_pages_per_compute_block(chip):
    info = pltpu.get_tpu_info(chip)
    slots = _kernel.SLOTS
    for page_size, itemsize in ((16, 2), (128, 2), (32, 1), (16, 4)):
        n = paged_attention_kernel.choose_pages_per_compute_block(page_size, 128, 2048, itemsize, info)
        assert 1 <= n <= _blocks.MAX_PAGES_PER_BLOCK
        assert slots * 2 * n * page_size * 128 * itemsize <= info.vmem_capacity_bytes // 4
    # int8 pages with a float32 scale a key: the scales take 128 lanes of VMEM each.
    n = paged_attention_kernel.choose_pages_per_compute_block(64, 128, 2048, 1, info, scales_dim=1)
    assert slots * 2 * n * 64 * (128 + 128 * 4) <= info.vmem_capacity_bytes // 4
    # 1 MiB of K and V a block: 2048 bf16 keys of 128 (32 pages of 64; 128 pages of 16).
    v5e = pltpu.get_tpu_info("v5e")
    assert paged_attention_kernel.choose_pages_per_compute_block(64, 128, 2048, 2, v5e) == 32
    assert paged_attention_kernel.choose_pages_per_compute_block(16, 128, 2048, 2, v5e) == 128
    assert paged_attention_kernel.choose_pages_per_compute_block(64, 128, 5, 2, info) == 5


def _call(**changes):
    q, k, v, lengths, pages = inputs(30, batch=2, q_heads=4, kv_heads=2, page_size=16, pages_per_seq=4,
                                     dtype=jnp.float32, lengths=[5, 9])  # fmt: skip
    args = dict(q=q, k_pages=k, v_pages=v, lengths=lengths, page_indices=pages)
    kw = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return lambda: paged_attention(**args, **kw, interpret=True)


BAD_CALLS = {
    "q not 3-d": (_call(q=jnp.ones((2, 4, 1, 128))), ValueError, r"q must be \[batch_size"),
    "k_pages not 4-d": (_call(k_pages=jnp.ones((2, 16, 128)), v_pages=jnp.ones((2, 16, 128))), ValueError, "k_pages must be"),
    "k and v differ": (_call(v_pages=jnp.ones((2, 13, 8, 128))), ValueError, "same shape"),
    "heads": (_call(q=jnp.ones((2, 3, 128))), ValueError, r"q heads \(3\) must be a multiple of the KV heads \(2\)"),
    "head_dim": (_call(q=jnp.ones((2, 4, 64))), ValueError, "head_dim 64 differs"),
    "int q": (_call(q=jnp.ones((2, 4, 128), jnp.int32)), TypeError, "q must be a float array"),
    "lengths dtype": (_call(lengths=jnp.array([5, 9], jnp.int64 if jax.config.x64_enabled else jnp.float32)), ValueError, "lengths must be int32"),
    "lengths batch": (_call(lengths=jnp.array([5], jnp.int32)), ValueError, r"lengths must be int32\[2\]"),
    "page_indices batch": (_call(page_indices=jnp.zeros((3, 4), jnp.int32)), ValueError, r"page_indices must be int32\[2, pages_per_sequence\]"),
    "block too big": (_call(pages_per_compute_block=5), ValueError, r"pages_per_compute_block must be an int in \[1, 4\]"),
    "megacore mode": (_call(megacore_mode="core"), ValueError, "megacore_mode must be one of"),
    "megacore kv heads odd": (_call(megacore_mode="kv_head", q=jnp.ones((2, 3, 128)), k_pages=jnp.ones((3, 13, 16, 128)), v_pages=jnp.ones((3, 13, 16, 128))), ValueError, "even number of KV heads"),
    "megacore batch odd": (_call(megacore_mode="batch", q=jnp.ones((1, 4, 128)), lengths=jnp.array([3], jnp.int32), page_indices=jnp.zeros((1, 4), jnp.int32)), ValueError, "even batch size"),
    "soft cap 0": (_call(attn_logits_soft_cap=0.0), ValueError, "attn_logits_soft_cap must not be 0"),
    "inline_seq_dim": (_call(inline_seq_dim="yes"), TypeError, "inline_seq_dim must be a bool"),
    "one quantized": (_call(k_pages=quantization_utils.quantize_to_int8(jnp.ones((2, 13, 16, 128)))), TypeError, "both be QuantizedTensor"),
    "scales shape": (_call(k_pages=quantization_utils.QuantizedTensor(jnp.ones((2, 13, 16, 128), jnp.int8), jnp.ones((2, 13, 16, 2)))), ValueError, "k_pages.scales must have shape"),
    "codes dtype": (_call(k_pages=quantization_utils.QuantizedTensor(jnp.ones((2, 13, 16, 128)), jnp.ones((2, 13, 16, 1)))), TypeError, "k_pages.weight must be int8"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS)
def test_paged_attention_bad_arguments(case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        call()


@every_way(op=True)
def test_page_index_outside_the_cache_gives_nan(way):
    """A page index out of the cache among a sequence's pages in use: that sequence's output is
    NaN (never attention over another page); entries past a sequence's length may hold anything."""
    q, k, v, lengths, pages = inputs(40, batch=3, q_heads=4, kv_heads=2, page_size=16, pages_per_seq=4,
                                     dtype=jnp.float32, lengths=[40, 20, 64])  # fmt: skip
    total = k.shape[1]
    pages = pages.at[0, 1].set(total).at[1, 3].set(-7).at[2, 2].set(-1)  # seq 1: past its length
    out = np.asarray(way.op(paged_attention, q, k, v, lengths, pages, pages_per_compute_block=2))
    assert np.isnan(out[0]).all() and np.isnan(out[2]).all()
    fine = jnp.clip(pages, 0, total - 1)  # sequence 1 reads none of the changed entries
    close(out[1], reference(q, k, v, lengths, fine)[1], way.dot_tol(2e-5))


def _rel_err(out, ref):
    out, ref = np.asarray(jnp.asarray(out, jnp.float32), np.float64), np.asarray(ref, np.float64)
    return np.abs(out - ref).max() / np.abs(ref).max()


def _f32_reference(q, k, v, lengths, pages, cap):
    """float32 jnp (precision highest) of the same inputs (int8 pages widened first)."""
    if isinstance(k, quantization_utils.QuantizedTensor):
        k, v = (t.weight.astype(jnp.float32) * t.scales / quantization_utils.MAX_INT8 for t in (k, v))
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, h, d = q.shape
    kh = k.shape[0]
    ks, vs = (x[:, pages].reshape(kh, b, -1, d) for x in (k, v))
    s = jnp.einsum("bhgd,hbtd->bhgt", q.reshape(b, kh, h // kh, d), ks, precision="highest")
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(jnp.arange(s.shape[-1]) < lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgt,hbtd->bhgd", p, vs, precision="highest").reshape(b, h, d)


@pytest.mark.parametrize(
    "dtype, logit_scale, cap, quantized",
    [("bfloat16", "D**-0.5", None, False), ("bfloat16", "1", 20.0, False), ("float32", "D**-0.5", None, False),
     ("bfloat16", "1", None, True)],
)  # fmt: skip
def test_accuracy_against_jax_op(dtype, logit_scale, cap, quantized):
    """Our max error against a float32 reference is at most JAX's (x1.1, + 1e-4), on unscaled
    random-normal keys and queries scaled by 1 or D**-0.5 (a sharp or a usual softmax)."""
    jax_pa = pytest.importorskip("jax.experimental.pallas.ops.tpu.paged_attention")
    from jax.experimental.pallas import tpu as jax_pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as jax_qu

    dtype = jnp.dtype(dtype)
    q, k, v, lengths, pages = inputs(int(np.random.default_rng().integers(1 << 20)), batch=2, q_heads=4,
                                     kv_heads=2, page_size=16, pages_per_seq=4, dtype=dtype, lengths=[37, 64])  # fmt: skip
    q = (q.astype(jnp.float32) * 128**0.5 * (128**-0.5 if logit_scale == "D**-0.5" else 1.0)).astype(dtype)
    ours_k, ours_v, their_k, their_v = k, v, k, v
    if quantized:
        ours_k, ours_v = quantization_utils.quantize_to_int8(k), quantization_utils.quantize_to_int8(v)
        their_k, their_v = jax_qu.QuantizedTensor(*ours_k), jax_qu.QuantizedTensor(*ours_v)
    kw = dict(pages_per_compute_block=2, attn_logits_soft_cap=cap)
    with jax.enable_checks(False), jax_pltpu.force_tpu_interpret_mode():
        theirs = jax_pa.paged_attention(q, their_k, their_v, lengths, pages, **kw)
    ours = paged_attention(q, ours_k, ours_v, lengths, pages, interpret=pltpu.InterpretParams(), **kw)
    ref = _f32_reference(q, ours_k, ours_v, lengths, pages, cap)
    ours_err, their_err = _rel_err(ours, ref), _rel_err(theirs, ref)
    print(
        f"paged_attention {dtype.name} scale {logit_scale} cap {cap} int8 {quantized}: ours {ours_err:.3e} JAX {their_err:.3e}"
    )
    assert ours_err <= 1.1 * their_err + 1e-4, (ours_err, their_err)


def test_lengths_past_the_pages_are_refused():
    """Known lengths beyond pages_per_sequence * page_size (or negative) raise; traced ones
    are clamped (documented)."""
    with pytest.raises(ValueError, match=r"paged_attention: lengths\[1\]=65 is outside \[0, 64\]"):
        _call(lengths=jnp.array([5, 65], jnp.int32))()
    with pytest.raises(ValueError, match=r"lengths\[0\]=-1 is outside"):
        _call(lengths=jnp.array([-1, 5], jnp.int32))()


def test_float_page_indices_holding_integers():
    """Float page indices holding integers give the int32 indices' result (JAX's op takes them);
    a fraction is refused naming the dtype expected."""
    q, k, v, lengths, pages = inputs(31, batch=2, q_heads=4, kv_heads=2, page_size=16, pages_per_seq=4,
                                     dtype=jnp.float32, lengths=[50, 9])  # fmt: skip
    out = paged_attention(q, k, v, lengths, pages.astype(jnp.float32), interpret=True)
    close(out, reference(q, k, v, lengths, pages), 2e-5)
    with pytest.raises(ValueError, match="page_indices must be int32 .or floats holding integers"):
        paged_attention(q, k, v, lengths, pages.astype(jnp.float32) + 0.5, interpret=True)


def test_jax_names():
    """JAX's module names: the copy descriptor (used in a kernel of ours) and the kernel names."""
    import inspect

    jax_kernel = pytest.importorskip("jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel")
    for name in ("MultiPageAsyncCopyDescriptor", "paged_flash_attention_kernel",
                 "paged_flash_attention_kernel_inline_seq_dim"):  # fmt: skip
        ours, theirs = getattr(paged_attention_kernel, name), getattr(jax_kernel, name)
        ours_params, theirs_params = (
            list(inspect.signature(ours).parameters),
            list(inspect.signature(theirs).parameters),
        )
        # JAX's parameters in JAX's order; beyond them only what a newer JAX adds (0.12: length).
        assert ours_params[: len(theirs_params)] == theirs_params
        assert set(ours_params[len(theirs_params) :]) <= {"length"}
    with pytest.raises(NotImplementedError, match="paged_flash_attention_kernel: JAX's kernel body"):
        paged_attention_kernel.paged_flash_attention_kernel(*range(18), batch_size=1, pages_per_compute_block=1,
            pages_per_sequence=1, mask_value=0.0, attn_logits_soft_cap=None, megacore_mode=None)  # fmt: skip

    pages_total, page_size = 7, 8
    k = rand(50, (2, pages_total, page_size, 128))
    table = jnp.array([5, 2, 6], jnp.int32)

    def kernel(table_ref, k_hbm, o_ref, buf, sem):
        copy = paged_attention_kernel.MultiPageAsyncCopyDescriptor(
            k_hbm, None, buf, None, sem, table_ref, 1, 2, 1
        )
        copy.start()
        o_ref[...] = copy.wait_and_get_loaded()

    import pallas as pl

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2 * page_size, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((2 * page_size, 128), lambda i, t: (0, 0)),
            scratch_shapes=[pltpu.VMEM((2, page_size, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        ),
        interpret=True,
    )(table, k)  # fmt: skip
    np.testing.assert_array_equal(out, np.asarray(k[1, np.array([2, 6])]).reshape(-1, 128))
