"""``pallas_tpu.ops.ragged_paged_attention`` against a float64 numpy reference on fresh random
data, and against JAX's op of the same name, run every way of an op (tests/ways'
``every_way(op=True)``).

JAX's op cannot run in JAX's own TPU interpret mode on a CPU (jax 0.10.2 and 0.11.2: its reads
through ``ref.reshape`` fail with "'ReshapeTransform' object has no attribute 'indices'"), so it
runs as ``test_jax_tpu_ops.py`` runs JAX's sources: unchanged but for the Pallas imports, in our
TPU interpret mode. JAX's plain-JAX ``ref_ragged_paged_attention`` is compared too."""

from __future__ import annotations

import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way

import pallas_tpu as pltpu
from pallas_tpu.ops import ragged_paged_attention as rpa
from pallas_tpu.ops.ragged_paged_attention import kernel, tuned_block_sizes

jax.config.update("jax_enable_checks", True)

# (q_len, kv_len) per sequence: decodes, prefill chunks over earlier keys, a whole prompt, an
# empty step; they straddle query blocks of 16 and share blocks with each other.
MIX = [(1, 37), (5, 60), (1, 3), (20, 20), (0, 9), (13, 40), (1, 64), (2, 2)]


def inputs(seed, mix=MIX, *, q_heads=4, kv_heads=2, page_size=8, pages_per_seq=8, max_seqs=10, tokens=48,
           q_dtype=jnp.float32, kv_dtype=jnp.float32):  # fmt: skip
    """q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs for the (q_len, kv_len) ``mix``."""
    total = max_seqs * pages_per_seq + 3
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (tokens, q_heads, 128), jnp.float32).astype(q_dtype)
    kv = jax.random.normal(keys[1], (total, page_size, 2 * kv_heads, 128), jnp.float32)
    kv = (kv * 4).astype(kv_dtype) if jnp.dtype(kv_dtype).itemsize == 1 else kv.astype(kv_dtype)
    kv_lens, cu = np.zeros(max_seqs, np.int32), np.zeros(max_seqs + 1, np.int32)
    for s, (q_len, kv_len) in enumerate(mix):
        kv_lens[s], cu[s + 1] = kv_len, cu[s] + q_len
    cu[len(mix) + 1 :] = cu[len(mix)]
    pages = jax.random.permutation(keys[2], total)[: max_seqs * pages_per_seq].reshape(
        max_seqs, pages_per_seq
    )
    return (
        q,
        kv,
        jnp.asarray(kv_lens),
        pages.astype(jnp.int32),
        jnp.asarray(cu),
        jnp.array([len(mix)], jnp.int32),
    )


def reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0, sliding_window=None,
              soft_cap=None, k_scale=None, v_scale=None):  # fmt: skip
    """float64 numpy, one sequence and q head at a time."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv_pages.astype(jnp.float32), np.float64)
    kv_heads = kv.shape[2] // 2
    groups = q.shape[1] // kv_heads
    out = np.zeros((int(cu_q_lens[int(num_seqs[0])]),) + q.shape[1:])
    for s in range(int(num_seqs[0])):
        lo, hi, n = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        cache = kv[np.asarray(page_indices[s])].reshape(-1, kv.shape[2], kv.shape[3])[:n]
        for t in range(lo, hi):
            pos = n - (hi - lo) + (t - lo)
            seen = np.arange(n) <= pos
            if sliding_window is not None:
                seen &= np.arange(n) > pos - sliding_window
            for h in range(q.shape[1]):
                k, v = (
                    cache[:, 2 * (h // groups)] * (k_scale or 1.0),
                    cache[:, 2 * (h // groups) + 1] * (v_scale or 1.0),
                )
                logits = (k @ q[t, h]) * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.where(seen, np.exp(logits - logits[seen].max()), 0.0)
                out[t, h] = (p / p.sum()) @ v
    return out


def close(out, ref, tol):
    out = np.asarray(out, np.float64)[: ref.shape[0]]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# (q dtype, kv dtype, inputs' keywords, op's keywords, tolerance)
CASES = {
    # Narrow and whole-block paths, KV blocks of 3 pages (pages skipped at both ends), the
    # sliding window, the soft cap and sm_scale.
    "f32_window_soft_cap": (
        jnp.float32, jnp.float32, {},
        dict(sm_scale=0.09, sliding_window=7, soft_cap=3.0, num_kv_pages_per_block=3, num_queries_per_block=16),
        2e-5,
    ),
    # bf16 (K and V of a head in one 32-bit word), blocks chosen by the op, 4 q heads per KV head.
    "bf16_default_blocks": (jnp.bfloat16, jnp.bfloat16, dict(q_heads=8), dict(sm_scale=0.09), 3e-2),
    # A float8 cache with k_scale/v_scale (4 heads per word), one q head per KV head (windows of 16).
    "fp8_scaled_mha": (
        jnp.bfloat16, jnp.float8_e4m3fn, dict(q_heads=4, page_size=16, pages_per_seq=4),
        dict(sm_scale=0.09, k_scale=0.5, v_scale=0.25, num_kv_pages_per_block=2, num_queries_per_block=8),
        3e-2,
    ),
    # 8 KV heads: two groups of 4 in the kernel's head loop (a traced group, each cache dtype's
    # strided loads past the group's first row).
    "f32_head_groups": (
        jnp.float32, jnp.float32, dict(q_heads=8, kv_heads=8),
        dict(sm_scale=0.09, num_kv_pages_per_block=2, num_queries_per_block=16), 2e-5,
    ),
    "bf16_head_groups": (
        jnp.bfloat16, jnp.bfloat16, dict(q_heads=16, kv_heads=8),
        dict(sm_scale=0.09, num_kv_pages_per_block=2, num_queries_per_block=16), 3e-2,
    ),
    "fp8_head_groups": (
        jnp.bfloat16, jnp.float8_e4m3fn, dict(q_heads=8, kv_heads=8, page_size=16, pages_per_seq=4),
        dict(sm_scale=0.09, k_scale=0.5, num_kv_pages_per_block=2, num_queries_per_block=8), 3e-2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@every_way(op=True)
def test_ragged_paged_attention(way, case):
    q_dtype, kv_dtype, shape, kw, tol = CASES[case]
    if case == "fp8_scaled_mha":
        shape = dict(shape, kv_heads=4)
    args = inputs(len(case), q_dtype=q_dtype, kv_dtype=kv_dtype, **shape)
    out = way.op(rpa.ragged_paged_attention, *args, **kw)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    want = reference(*args, **{k: v for k, v in kw.items() if not k.startswith("num_")})
    close(out, want, way.dot_tol(tol, q_dtype))


@pytest.fixture(scope="module")
def jax_ported():
    """JAX's ragged_paged_attention module, its Pallas imports pointed at ours."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    from test_jax_tpu_ops import PORTED, _PortedOpsFinder

    finder = _PortedOpsFinder()
    sys.meta_path.insert(0, finder)
    yield importlib.import_module(f"{PORTED}.ragged_paged_attention.kernel")
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == PORTED or n.startswith(PORTED + ".")]:
        del sys.modules[name]


def test_matches_jax_op(jax_ported):
    """JAX's kernel and ours on a bf16 mix with a sliding window and a soft cap, and JAX's
    reference beside ours."""
    mix = [(1, 37), (9, 30), (0, 5), (2, 2)]
    args = inputs(3, mix, max_seqs=5, tokens=16, pages_per_seq=5, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    kw = dict(sm_scale=0.09, sliding_window=9, soft_cap=4.0)
    blocks = dict(num_kv_pages_per_block=2, num_queries_per_block=8)
    with jax.enable_checks(False), pltpu.force_tpu_interpret_mode():
        theirs = jax_ported.ragged_paged_attention(*args, **kw, **blocks)
    ours = rpa.ragged_paged_attention(*args, **kw, **blocks, interpret=pltpu.InterpretParams())
    n = int(args[4][int(args[5][0])])
    close(ours, np.asarray(theirs[:n], np.float64), 3e-2)
    close(ours, reference(*args, **kw), 3e-2)
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_kernel

    np.testing.assert_allclose(
        np.asarray(rpa.ref_ragged_paged_attention(*args, **kw), np.float32),
        np.asarray(jax_kernel.ref_ragged_paged_attention(*args, **kw), np.float32),
        atol=1e-2,
    )


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_block_sizes_fit_each_chip(chip):
    info = pltpu.get_tpu_info(chip)
    for kv_heads, page_size, dtype in ((8, 16, jnp.bfloat16), (1, 128, jnp.float32), (32, 64, jnp.int8)):
        pages, queries = rpa.get_tuned_block_sizes(
            jnp.bfloat16, dtype, 4 * kv_heads, kv_heads, 128, page_size, 2048, 512, info=info
        )
        assert 1 <= pages <= 512 and queries % tuned_block_sizes.query_window(4) == 0
        assert (
            pages * page_size * 2 * kv_heads * 128 * jnp.dtype(dtype).itemsize
            <= info.vmem_capacity_bytes // 8
        )
    assert rpa.get_tuned_block_sizes(jnp.bfloat16, jnp.bfloat16, 4, 1, 128, 16, 8, 3, info=info) == (3, 8)
    if chip == "v5e":  # 2 MiB of K and V a block: 512 tokens of 8 bf16 KV heads; 512 score rows
        assert rpa.get_tuned_block_sizes(
            jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 16, 2048, 512, info=info
        ) == (32, 128)
    assert tuned_block_sizes.get_min_page_size(8192) == 512 and tuned_block_sizes.next_power_of_2(17) == 32


def _args(**changes):
    args = dict(zip(("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"), inputs(5)))
    kw = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return args, kw


def _call(**changes):
    args, kw = _args(**changes)
    return lambda: rpa.ragged_paged_attention(*args.values(), **kw, interpret=True)


BAD_CALLS = {
    "q not 3-d": (_call(q=jnp.ones((48, 4, 1, 128))), ValueError, r"q must be \[max_num_batched_tokens"),
    "kv_pages not 4-d": (_call(kv_pages=jnp.ones((8, 4, 128))), ValueError, "kv_pages must be"),
    "odd combined heads": (_call(kv_pages=jnp.ones((83, 8, 3, 128))), ValueError, r"combined heads \(3\) must be even"),
    "head_dim": (_call(q=jnp.ones((48, 4, 64))), ValueError, "head_dim 64 differs"),
    "q heads": (_call(q=jnp.ones((48, 3, 128))), ValueError, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    "num_seqs shape": (_call(num_seqs=jnp.array([1, 2], jnp.int32)), ValueError, r"num_seqs must have shape \(1,\)"),
    "kv_lens shape": (_call(kv_lens=jnp.zeros(9, jnp.int32)), ValueError, r"kv_lens must have shape \(10,\)"),
    "cu_q_lens shape": (_call(cu_q_lens=jnp.zeros(10, jnp.int32)), ValueError, r"cu_q_lens must have shape \(11,\)"),
    "page_indices 1-d": (_call(page_indices=jnp.zeros(80, jnp.int32)), ValueError, r"page_indices must be \[max_num_seqs"),
    "kv_lens dtype": (_call(kv_lens=jnp.zeros(10, jnp.float32)), ValueError, "kv_lens must be int32"),
    "q dtype": (_call(q=jnp.ones((48, 4, 128), jnp.float16)), TypeError, "q must be float32 or bfloat16"),
    "kv dtype": (_call(kv_pages=jnp.ones((83, 8, 4, 128), jnp.int16)), TypeError, "kv_pages must be one of"),
    "8-bit heads": (_call(kv_pages=jnp.ones((83, 8, 2, 128), jnp.int8), q=jnp.ones((48, 1, 128))), ValueError, "combined heads in multiples of 4"),
    "k_scale type": (_call(k_scale=1), TypeError, "k_scale must be a float or None"),
    "sliding window": (_call(sliding_window=0), ValueError, "sliding_window=0 must be a positive int"),
    "soft cap": (_call(soft_cap=0.0), ValueError, "soft_cap=0.0 must not be 0.0"),
    "kv pages per block": (_call(num_kv_pages_per_block=9), ValueError, r"num_kv_pages_per_block=9 must be in \(0, 8\]"),
    "queries per block": (_call(num_queries_per_block=0), ValueError, "num_queries_per_block=0 must be positive"),
    "vmem limit": (_call(vmem_limit_bytes=-1), ValueError, "vmem_limit_bytes=-1 must be positive"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS)
def test_ragged_paged_attention_bad_arguments(case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        call()


DYNAMIC_BAD = {
    "num_seqs": (dict(num_seqs=jnp.array([11], jnp.int32)), r"num_seqs\[0\]=11 must be in \[0, 10\]"),
    "too few pages": (dict(kv_lens=jnp.full(10, 65, jnp.int32)), "pages_per_seq=8 pages of 8 hold fewer than the longest kv_lens 65"),
    "tokens past q": (dict(q=jnp.ones((40, 4, 128))), r"cu_q_lens\[num_seqs\]=43 query tokens exceed q's 40 rows"),
    "more queries than keys": (dict(kv_lens=jnp.full(10, 4, jnp.int32)), "sequence 1 has 5 query tokens and kv_lens 4"),
}  # fmt: skip


@pytest.mark.parametrize("case", DYNAMIC_BAD)
def test_dynamic_validate_inputs(case):
    changes, message = DYNAMIC_BAD[case]
    args, _ = _args(**changes)
    with pytest.raises(ValueError, match=message):
        rpa.dynamic_validate_inputs(*args.values())
    rpa.dynamic_validate_inputs(*_args()[0].values())  # the unchanged inputs pass
    assert kernel.get_dtype_packing(jnp.bfloat16) == 2


@pytest.mark.parametrize(
    "q_dtype, kv_dtype, sm_scale, extra",
    [("bfloat16", "bfloat16", 128**-0.5, {}), ("bfloat16", "bfloat16", 1.0, dict(soft_cap=20.0, sliding_window=9)),
     ("bfloat16", "float8_e4m3fn", 128**-0.5, dict(k_scale=0.5, v_scale=0.25))],
)  # fmt: skip
def test_accuracy_against_jax_op(jax_ported, q_dtype, kv_dtype, sm_scale, extra):
    """Our max error against a float64 reference is at most JAX's kernel's (x1.1, + 1e-4), on
    unscaled random-normal q and keys, sm_scale 1 or D**-0.5."""
    mix = [(1, 37), (9, 30), (0, 5), (2, 2)]
    seed = int(np.random.default_rng().integers(1 << 20))
    args = inputs(seed, mix, max_seqs=5, tokens=16, pages_per_seq=5, q_dtype=q_dtype, kv_dtype=kv_dtype)
    kw = dict(sm_scale=sm_scale, **extra)
    blocks = dict(num_kv_pages_per_block=2, num_queries_per_block=8)
    with jax.enable_checks(False), pltpu.force_tpu_interpret_mode():
        theirs = jax_ported.ragged_paged_attention(*args, **kw, **blocks)
    ours = rpa.ragged_paged_attention(*args, **kw, **blocks, interpret=pltpu.InterpretParams())
    ref = reference(*args, **kw)
    n, scale = ref.shape[0], np.abs(ref).max()
    ours_err = np.abs(np.asarray(ours[:n], np.float64) - ref).max() / scale
    their_err = np.abs(np.asarray(theirs[:n], np.float64) - ref).max() / scale
    print(
        f"ragged_paged_attention {q_dtype}/{kv_dtype} sm_scale {sm_scale:.3g} {extra}: ours {ours_err:.3e} JAX {their_err:.3e}"
    )
    assert ours_err <= 1.1 * their_err + 1e-4, (ours_err, their_err)


def test_tpu_version_and_device_name_as_jax():
    """On this host JAX's functions and ours agree (a CPU host: -1, "cpu", and
    get_tuned_block_sizes raising NotImplementedError without a chip)."""
    jax_tbs = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes")
    assert tuned_block_sizes.get_tpu_version() == jax_tbs.get_tpu_version()
    assert tuned_block_sizes.get_device_name() == jax_tbs.get_device_name()
    assert tuned_block_sizes.get_device_name(4) == jax_tbs.get_device_name(4)
    key = (jnp.bfloat16, jnp.bfloat16, 4, 2, 128, 16, 64, 8)
    if jax_tbs.get_tpu_version() < 4:
        with pytest.raises(NotImplementedError, match="get_tuned_block_sizes: the TPU version must be 4"):
            tuned_block_sizes.get_tuned_block_sizes(*key)
    pages, queries = tuned_block_sizes.get_tuned_block_sizes(*key, info=pltpu.get_tpu_info("v5e"))
    assert 1 <= pages <= 8 and queries >= 8


def test_jax_names():
    import inspect

    jax_kernel = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
    for name in ("MultiPageAsyncCopyDescriptor", "ragged_paged_attention_kernel"):
        ours, theirs = getattr(kernel, name), getattr(jax_kernel, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    with pytest.raises(NotImplementedError, match="ragged_paged_attention_kernel: JAX's kernel body"):
        kernel.ragged_paged_attention_kernel(*range(13), sm_scale=1.0)
