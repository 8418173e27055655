"""JAX's splash attention internals that frameworks build on, against JAX's own: the mask infos
of ``process_mask(_dkv)`` and ``process_dynamic_mask(_dkv)`` on fresh random masks (every
field, value and dtype), ``get_kernel_name``, the type names, ``attention_reference_custom``
(values and gradients) and ``flash_attention_kernel`` (not provided: it raises)."""

from __future__ import annotations

import itertools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_tpu.ops.splash_attention import splash_attention_kernel as ours_kernel
from pallas_tpu.ops.splash_attention import splash_attention_mask as ours_mask
from pallas_tpu.ops.splash_attention import splash_attention_mask_info as ours_info

JAX_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention"
jax_info = pytest.importorskip(f"{JAX_SPLASH}.splash_attention_mask_info")
jax_mask = pytest.importorskip(f"{JAX_SPLASH}.splash_attention_mask")
jax_kernel = pytest.importorskip(f"{JAX_SPLASH}.splash_attention_kernel")

Q_LEN, KV_LEN, BQ, BKV = 128, 256, 16, 32


@pytest.fixture
def rng(request):
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"{request.node.name}: seed {seed}")
    return np.random.default_rng(seed)


def random_block_mask(rng, q_len=Q_LEN, kv_len=KV_LEN, bq=BQ, bkv=BKV, empty=1 / 3):
    """A dense mask whose blocks are at random empty (probability ``empty``), full or partial
    (some partial blocks repeated, so that deduplication is exercised); every block row has a
    partial block."""
    nq, nkv = q_len // bq, kv_len // bkv
    kinds = np.where(rng.random((nq, nkv)) < empty, 0, rng.integers(1, 3, (nq, nkv)))
    kinds[np.arange(nq), rng.integers(0, nkv, nq)] = 1
    pool = [rng.random((bq, bkv)) < 0.5 for _ in range(3)]
    dense = np.zeros((q_len, kv_len), bool)
    for i, j in np.ndindex(nq, nkv):
        block = {0: np.zeros((bq, bkv), bool), 2: np.ones((bq, bkv), bool)}.get(int(kinds[i, j]))
        if block is None:
            block = pool[rng.integers(0, 3)] if rng.random() < 0.5 else rng.random((bq, bkv)) < 0.5
            block = block.copy()
            block[0, 0], block[-1, -1] = True, False  # partial for sure
        dense[i * bq : (i + 1) * bq, j * bkv : (j + 1) * bkv] = block
    return dense


def assert_same_info(got, want, where):
    assert type(got).__name__ == "MaskInfo" and got._fields == want._fields, where
    for field in want._fields:
        a, b = getattr(got, field), getattr(want, field)
        if b is None or isinstance(b, bool):
            assert a is b or a == b, f"{where}: {field} {a!r} != {b!r}"
            continue
        assert a is not None, f"{where}: {field} is None, JAX's is not"
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"{where}: {field} dtype {a.dtype} != {b.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=f"{where}: {field}")


# Head layouts: which random dense mask each of 4 heads takes.
LAYOUTS = {
    "one_mask": [0, 0, 0, 0],
    "one_per_head_shard": [0, 0, 1, 1],
    "per_head": [0, 1, 0, 2],
}


@pytest.mark.parametrize("dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_shards,q_seq_shards", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
@pytest.mark.parametrize("shrink_grid", [True, False])
@pytest.mark.parametrize("empty", [0.3, 0.8])
def test_process_mask_matches_jax(rng, dkv, layout, head_shards, q_seq_shards, shrink_grid, empty):
    denses = [random_block_mask(rng, empty=empty) for _ in range(3)]
    heads = [denses[i] for i in LAYOUTS[layout]]
    ours = ours_mask.MultiHeadMask([ours_mask.NumpyMask(d) for d in heads])
    theirs = jax_mask.MultiHeadMask([jax_mask.NumpyMask(d) for d in heads])
    name = "process_mask_dkv" if dkv else "process_mask"
    for downcast in (True, False):
        kw = dict(
            downcast_smem_data=downcast,
            head_shards=head_shards,
            q_seq_shards=q_seq_shards,
            shrink_grid=shrink_grid,
        )
        got, got_fn = getattr(ours_info, name)(ours, (BQ, BKV), **kw)
        want, want_fn = getattr(jax_info, name)(theirs, (BQ, BKV), **kw)
        assert got_fn is None and want_fn is None
        assert_same_info(got, want, f"{name} {kw}")


@pytest.mark.parametrize("dkv", [False, True], ids=["fwd", "dkv"])
def test_process_mask_numpy_blocks_small_and_large(rng, dkv):
    """Larger grids (int16 indices) and one-block grids."""
    name = "process_mask_dkv" if dkv else "process_mask"
    for q_len, kv_len, bq, bkv in ((2048, 1024, 8, 8), (64, 64, 64, 64)):
        dense = random_block_mask(rng, q_len, kv_len, bq, bkv)
        got, _ = getattr(ours_info, name)(ours_mask.MultiHeadMask([ours_mask.NumpyMask(dense)]), (bq, bkv))
        want, _ = getattr(jax_info, name)(jax_mask.MultiHeadMask([jax_mask.NumpyMask(dense)]), (bq, bkv))
        assert_same_info(got, want, f"{name} {q_len}x{kv_len}")


STRUCTURED = {
    "causal": lambda m, s: m.CausalMask(s),
    "causal_offset": lambda m, s: m.CausalMask(s, offset=40),
    "local": lambda m, s: m.LocalMask(s, (48, 16), 0),
    "chunked": lambda m, s: m.ChunkedCausalMask(s, 64),
    "full": lambda m, s: m.FullMask(s),
}


@pytest.mark.parametrize("name", list(STRUCTURED))
@pytest.mark.parametrize("dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("head_shards,q_seq_shards", [(1, 1), (2, 2)])
def test_process_mask_structured_matches_jax(name, dkv, head_shards, q_seq_shards):
    shape = (256, 256)
    make = STRUCTURED[name]
    ours = ours_mask.MultiHeadMask([make(ours_mask, shape)] * 2)
    theirs = jax_mask.MultiHeadMask([make(jax_mask, shape)] * 2)
    fn_name = "process_mask_dkv" if dkv else "process_mask"
    kw = dict(head_shards=head_shards, q_seq_shards=q_seq_shards)
    if name == "full" and q_seq_shards > 1:
        # JAX fails here (a shrunk grid over several q shards with no partial block); ours
        # gives mask_next None. Compare without shrinking.
        kw["shrink_grid"] = False
    got, got_fn = getattr(ours_info, fn_name)(ours, (32, 64), **kw)
    want, want_fn = getattr(jax_info, fn_name)(theirs, (32, 64), **kw)
    assert_same_info(got, want, f"{name} {fn_name} {kw}")
    assert (got_fn is None) == (want_fn is None)
    if want_fn is not None:
        q, kv = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
        np.testing.assert_array_equal(
            np.broadcast_to(np.asarray(got_fn(q, kv)), shape),
            np.broadcast_to(np.asarray(want_fn(q, kv)), shape),
        )


def test_process_mask_errors():
    mask = ours_mask.MultiHeadMask([ours_mask.CausalMask((128, 128))] * 2)
    for kw, match in (
        (dict(q_seq_shards=3), "q_seq_shards=3 should divide"),
        (dict(head_shards=3), "head_shards=3 should divide"),
        (dict(q_seq_shards=16), "should divide q_seq_len_per_shard"),
    ):
        with pytest.raises(ValueError, match=match):
            ours_info.process_mask(mask, (16, 16), **kw)
    with pytest.raises(ValueError, match="kv_block_size=48 should divide"):
        ours_info.process_mask(mask, (16, 48))
    hidden = np.zeros((64, 64), bool)
    hidden[32:] = np.eye(32, 64, dtype=bool)  # the first q shard sees nothing
    for process in (ours_info.process_mask, ours_info.process_mask_dkv):
        with pytest.raises(ValueError, match="pass shrink_grid=False"):
            process(ours_mask.MultiHeadMask([ours_mask.NumpyMask(hidden)]), (16, 16), q_seq_shards=2)
        info, _ = process(
            ours_mask.MultiHeadMask([ours_mask.NumpyMask(hidden)]),
            (16, 16),
            q_seq_shards=2,
            shrink_grid=False,
        )
        want, _ = getattr(jax_info, process.__name__)(
            jax_mask.MultiHeadMask([jax_mask.NumpyMask(hidden)]), (16, 16), q_seq_shards=2, shrink_grid=False
        )
        assert_same_info(info, want, process.__name__)


@pytest.mark.parametrize("dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("head_shards,q_seq_shards", [(1, 1), (2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("downcast", [True, False])
def test_process_dynamic_mask_matches_jax(rng, dkv, head_shards, q_seq_shards, downcast):
    name = "process_dynamic_mask_dkv" if dkv else "process_dynamic_mask"
    dense = np.stack([random_block_mask(rng) for _ in range(4)])
    dense[1] = dense[0]
    mask = jnp.asarray(dense)
    kw = dict(downcast_smem_data=downcast, head_shards=head_shards, q_seq_shards=q_seq_shards)
    want, want_fn = getattr(jax_info, name)(mask, (BQ, BKV), **kw)
    got, got_fn = getattr(ours_info, name)(mask, (BQ, BKV), **kw)
    assert got_fn is None and want_fn is None
    assert_same_info(got, want, f"{name} {kw}")
    # Traceable: the same under jit.
    traced = jax.jit(lambda m: getattr(ours_info, name)(m, (BQ, BKV), **kw)[0])(mask)
    assert_same_info(traced, want, f"{name} {kw} (jit)")


def test_process_dynamic_mask_large_indices(rng):
    """mask_next past int8 (int16), data_next past int8 on a long kv axis."""
    dense = rng.random((2, 64, 2048)) < 0.5
    for name in ("process_dynamic_mask", "process_dynamic_mask_dkv"):
        got, _ = getattr(ours_info, name)(jnp.asarray(dense), (8, 8))
        want, _ = getattr(jax_info, name)(jnp.asarray(dense), (8, 8))
        assert_same_info(got, want, name)


def test_process_dynamic_mask_errors():
    with pytest.raises(ValueError, match="Expected a bool mask"):
        ours_info.process_dynamic_mask(jnp.ones((1, 16, 16), jnp.int32), (8, 8))
    with pytest.raises(ValueError, match="Expected a 3-dim mask"):
        ours_info.process_dynamic_mask(jnp.ones((16, 16), bool), (8, 8))
    with pytest.raises(ValueError, match="q_block_size=12 should divide"):
        ours_info.process_dynamic_mask(jnp.ones((1, 16, 16), bool), (12, 8))


def test_get_kernel_name_matches_jax():
    for is_mqa, residuals, segmented, phase in itertools.product(
        (False, True), (False, True), (False, True), ("fwd", "dq", "dkv")
    ):
        if residuals and phase != "fwd":
            with pytest.raises(ValueError, match="only the 'fwd' phase"):
                ours_kernel.get_kernel_name(is_mqa, residuals, segmented, phase)
            continue
        args = (is_mqa, residuals, segmented, phase)
        assert ours_kernel.get_kernel_name(*args) == jax_kernel.get_kernel_name(*args)
        assert ours_kernel.get_kernel_name(
            is_mqa=is_mqa, save_residuals=residuals, is_segmented=segmented, phase=phase
        ) == jax_kernel.get_kernel_name(*args)
    with pytest.raises(ValueError, match="phase must be"):
        ours_kernel.get_kernel_name(False, False, False, "bwd")


def _shape_of(tp):
    """A type alias as nested (origin name, args) with class names only."""
    args = typing.get_args(tp)
    if not args:
        return getattr(tp, "__name__", repr(tp))
    origin = typing.get_origin(tp)
    name = (
        "Union"
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None))
        else origin.__name__
    )
    return (name, tuple(_shape_of(a) for a in args))


@pytest.mark.parametrize("name", ["MaskFunctionType", "SplashResidualsType", "SplashCustomReturnType"])
def test_type_names_match_jax(name):
    assert _shape_of(getattr(ours_kernel, name)) == _shape_of(getattr(jax_kernel, name))


def test_mask_info_fields_match_jax():
    assert ours_info.MaskInfo._fields == jax_info.MaskInfo._fields
    assert ours_info.MaskInfo._field_defaults == jax_info.MaskInfo._field_defaults


@pytest.mark.parametrize("custom_type", ["flash", "vanilla"])
@pytest.mark.parametrize("variant", ["plain", "segments", "sinks", "soft_cap"])
def test_attention_reference_custom_matches_jax(rng, custom_type, variant):
    q_len, kv_len, d = 64, 128, 32
    mask = rng.random((q_len, kv_len)) < 0.6
    mask[np.arange(q_len), np.arange(q_len)] = True  # every row sees a key
    mask = jnp.asarray(mask)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((q_len, d), (kv_len, d), (kv_len, d))
    )
    do = jnp.asarray(rng.standard_normal((q_len, d)), jnp.float32)
    segment_ids, sinks, cap = None, None, None
    if variant == "segments":
        ids = jnp.asarray(np.arange(kv_len) // 32, jnp.int32)
        segment_ids = (ours_kernel.SegmentIds(ids[:q_len], ids), jax_kernel.SegmentIds(ids[:q_len], ids))
    if variant == "sinks":
        sinks = jnp.asarray(rng.standard_normal(), jnp.float32)
    if variant == "soft_cap":
        cap = 3.0

    def loss(module, seg):
        def f(q, k, v, sinks):
            out = module.attention_reference_custom(
                mask, q, k, v, seg, sinks, custom_type=custom_type, attn_logits_soft_cap=cap
            )
            return jnp.sum(out * do), out

        return f

    args = (q, k, v, sinks)
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    seg_ours, seg_jax = segment_ids if segment_ids is not None else (None, None)
    (_, out), grads = jax.value_and_grad(loss(ours_kernel, seg_ours), argnums, has_aux=True)(*args)
    (_, out_j), grads_j = jax.value_and_grad(loss(jax_kernel, seg_jax), argnums, has_aux=True)(*args)
    np.testing.assert_allclose(out, out_j, rtol=1e-5, atol=1e-5)
    for g, gj in zip(grads, grads_j):
        np.testing.assert_allclose(g, gj, rtol=1e-4, atol=1e-4)
    lse = ours_kernel.attention_reference_custom(mask, q, k, v, seg_ours, sinks, save_residuals=True)[1][0]
    lse_j = jax_kernel.attention_reference_custom(mask, q, k, v, seg_jax, sinks, save_residuals=True)[1][0]
    np.testing.assert_allclose(lse, lse_j, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="Higher-order AD"):
        jax.grad(
            lambda q: ours_kernel.attention_reference_custom(mask, q, k, v, None, save_residuals=True)[
                0
            ].sum()
        )(q)


def test_flash_attention_kernel_is_not_provided():
    assert ours_kernel.flash_attention_kernel.__doc__.startswith("NOT PROVIDED")
    with pytest.raises(NotImplementedError, match="make_splash_mha"):
        ours_kernel.flash_attention_kernel(
            *[None] * 15,
            **{
                k: None
                for k in (
                    "mask_value",
                    "grid_width",
                    "bq",
                    "bkv",
                    "bkv_compute",
                    "head_dim_v",
                    "q_layout",
                    "k_layout",
                    "v_layout",
                    "attn_logits_soft_cap",
                    "mask_function",
                )
            },
        )
