"""``pallas_tpu.ops.splash_attention`` masks and their block schedules: each mask against its
dense NumPy form and JAX's mask class of the same name, the empty/partial/full classification of
its blocks against the dense mask, the kernel's mask function against the dense mask, and the
packed schedules (every visible block exactly once, in the kernels' order; hidden blocks never;
sharded schedules the slices of the whole one)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_tpu.ops import splash_attention as sa
from pallas_tpu.ops.splash_attention import splash_attention_mask as mask_lib
from pallas_tpu.ops.splash_attention import splash_attention_mask_info as info_lib

EMPTY, PARTIAL, FULL = mask_lib.EMPTY, mask_lib.PARTIAL, mask_lib.FULL


def dense_kinds(dense, bq, bkv):
    nq, nkv = dense.shape[0] // bq, dense.shape[1] // bkv
    tiles = dense.reshape(nq, bq, nkv, bkv)
    return np.where(tiles.all(axis=(1, 3)), FULL, np.where(tiles.any(axis=(1, 3)), PARTIAL, EMPTY))


SHAPE = (512, 768)
MASKS = {
    "causal": (lambda m: m.CausalMask(SHAPE), lambda: sa.make_causal_mask(SHAPE)),
    "causal_offset": (lambda m: m.CausalMask(SHAPE, offset=200), lambda: sa.make_causal_mask(SHAPE, 200)),
    "causal_negative_offset": (lambda m: m.CausalMask(SHAPE, offset=-70), lambda: sa.make_causal_mask(SHAPE, -70)),
    "local": (lambda m: m.LocalMask(SHAPE, (100, 30), 10), lambda: sa.make_local_attention_mask(SHAPE, (100, 30), offset=10)),
    "local_left_only": (lambda m: m.LocalMask(SHAPE, (300, None), 0), lambda: sa.make_local_attention_mask(SHAPE, (300, None))),
    "local_right_only": (lambda m: m.LocalMask(SHAPE, (None, 5), 0), lambda: sa.make_local_attention_mask(SHAPE, (None, 5))),
    "local_unbounded": (lambda m: m.LocalMask(SHAPE, (None, None), 0), lambda: np.ones(SHAPE, bool)),
    "chunked_pow2": (lambda m: m.ChunkedCausalMask(SHAPE, 128), lambda: mask_lib.make_chunk_attention_mask(SHAPE, 128)),
    "chunked_odd": (lambda m: m.ChunkedCausalMask(SHAPE, 100), lambda: mask_lib.make_chunk_attention_mask(SHAPE, 100)),
    "full": (lambda m: m.FullMask(SHAPE), lambda: np.ones(SHAPE, bool)),
    "numpy": (lambda m: m.NumpyMask(m.make_random_mask(SHAPE, 0.9, 3)), lambda: sa.make_random_mask(SHAPE, 0.9, 3)),
    "and": (
        lambda m: m.CausalMask(SHAPE) & m.LocalMask(SHAPE, (128, None), 0),
        lambda: sa.make_causal_mask(SHAPE) & sa.make_local_attention_mask(SHAPE, (128, None)),
    ),
    "or": (
        lambda m: m.LocalMask(SHAPE, (0, 0), 0) | m.NumpyMask(sa.make_random_mask(SHAPE, 0.99, 1)),
        lambda: sa.make_local_attention_mask(SHAPE, (0, 0)) | sa.make_random_mask(SHAPE, 0.99, 1),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_dense_kinds_and_function(name):
    make, dense_of = MASKS[name]
    mask, dense = make(sa), dense_of()
    assert mask.shape == SHAPE
    np.testing.assert_array_equal(mask[:, :], dense)
    np.testing.assert_array_equal(mask[100:300, 64:500], dense[100:300, 64:500])
    for bq, bkv in ((128, 128), (128, 256), (256, 128), (512, 768)):
        np.testing.assert_array_equal(
            mask.block_kinds(bq, bkv), dense_kinds(dense, bq, bkv), err_msg=f"{bq}x{bkv}"
        )
    f = mask.kernel_function
    if f is not None:  # what the kernel evaluates on a block's global positions
        q, kv = np.meshgrid(np.arange(SHAPE[0]), np.arange(SHAPE[1]), indexing="ij")
        np.testing.assert_array_equal(np.broadcast_to(f(q, kv), SHAPE), dense)
    assert (f is None) == (name in ("numpy", "or", "chunked_odd"))


@pytest.mark.parametrize("name", ["causal", "local", "chunked_pow2", "full", "numpy"])
def test_mask_matches_jax_class(name):
    jmask = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask")
    ours, theirs = MASKS[name][0](sa), MASKS[name][0](jmask)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours[:, :], theirs[:, :])
    assert ours == MASKS[name][0](sa) and hash(ours) == hash(MASKS[name][0](sa))


def test_mask_errors():
    with pytest.raises(NotImplementedError, match="no truth value"):
        bool(sa.CausalMask(SHAPE))
    with pytest.raises(ValueError, match="Invalid shape for other"):
        sa.CausalMask(SHAPE) & sa.CausalMask((512, 512))
    with pytest.raises(TypeError, match="combine with other masks"):
        sa.CausalMask(SHAPE) | np.ones(SHAPE, bool)
    with pytest.raises(ValueError, match="at least one mask"):
        sa.MultiHeadMask([])
    with pytest.raises(ValueError, match="should be of type Mask"):
        sa.MultiHeadMask([np.ones(SHAPE, bool)])
    with pytest.raises(ValueError, match="Unexpected mask shape"):
        sa.MultiHeadMask([sa.CausalMask(SHAPE), sa.CausalMask((512, 512))])
    with pytest.raises(ValueError, match="nesting"):
        sa.MultiHeadMask([sa.MultiHeadMask([sa.CausalMask(SHAPE)])])
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        sa.ChunkedCausalMask(SHAPE, 0)
    with pytest.raises(ValueError, match="Expected a 2-dim"):
        sa.NumpyMask(np.ones((2, 2, 2), bool))
    with pytest.raises(ValueError, match="must be a boolean array"):
        sa.NumpyMask(np.ones((2, 2), np.int8))
    with pytest.raises(ValueError, match="shard_count=3 must divide"):
        sa.CausalMask(SHAPE, shard_count=3)
    with pytest.raises(ValueError, match="window_size must be"):
        sa.LocalMask(SHAPE, (1, 2, 3), 0)
    with pytest.raises(ValueError, match="FullMask"):
        sa.FullMask([512, 512])
    with pytest.raises(NotImplementedError, match="unit-step slices"):
        sa.CausalMask(SHAPE)[::2, :]
    with pytest.raises(ValueError, match="must be divisible by the blocks"):
        sa.CausalMask(SHAPE).block_kinds(384, 128)


def test_reordered_queries_are_materialized():
    """A q_sequence other than arange (striped queries) is honoured by the dense mask; the kernel
    then loads the partial blocks instead of computing them."""
    mask = sa.CausalMask(SHAPE)
    mask.q_sequence = np.random.default_rng(0).permutation(SHAPE[0]).astype(np.int32)
    dense = mask.q_sequence[:, None] >= np.arange(SHAPE[1])[None, :]
    np.testing.assert_array_equal(mask[:, :], dense)
    np.testing.assert_array_equal(mask.block_kinds(128, 128), dense_kinds(dense, 128, 128))
    assert mask.kernel_function is None


# ---------------------------------------------------------------------------------------------
# Schedules.


def visits(info, patterns):
    """{(mask row, shard): [(q block, kv block, chunk kinds or None, first, last), ...]} of the
    real steps (not the padding)."""
    steps = np.asarray(info.steps)
    rows, shards, n = steps.shape
    out = {}
    for r in range(rows):
        for s in range(shards):
            f = info_lib.unpack(steps[r, s])
            seq = []
            for t in range(n):
                code = int(f["pattern"][t])
                if code == 0 and not f["first"][t]:
                    continue  # padding
                chunks = patterns[code - 1] if code else None
                seq.append(
                    (
                        int(f["q_block"][t]),
                        int(f["kv_block"][t]),
                        chunks,
                        bool(f["first"][t]),
                        bool(f["last"][t]),
                    )
                )
            out[r, s] = seq
    return out


@pytest.mark.parametrize("kv_major", [False, True], ids=["q_major", "kv_major"])
@pytest.mark.parametrize("shards", [(1, 1), (2, 2)])
def test_schedule_visits_each_visible_block_once(kv_major, shards):
    head_shards, q_shards = shards
    masks = [
        sa.CausalMask(SHAPE),
        sa.NumpyMask(sa.make_random_mask(SHAPE, 0.97, 0)),
        sa.CausalMask(SHAPE),
        sa.LocalMask(SHAPE, (64, 0), 0),
    ]
    # A q block hidden wholly, so that its step of nothing shows.
    hidden = np.ones(SHAPE, bool)
    hidden[128:256] = False
    masks[1] = sa.NumpyMask(masks[1].array & ~hidden)
    mask = sa.MultiHeadMask(masks)
    process = info_lib.process_schedule_dkv if kv_major else info_lib.process_schedule
    info, function, patterns = process(
        mask, (128, 256), head_shards=head_shards, q_seq_shards=q_shards, block_kv_compute=128
    )
    assert function is None  # different masks per head
    assert info.steps.shape[:2] == (4, q_shards)  # one row per head: they differ
    assert all(len(p) == 1 and len(p[0]) == 2 for p in patterns) and len(patterns) <= info_lib.MAX_PATTERNS
    nq_shard = SHAPE[0] // 128 // q_shards
    for (r, s), seq in visits(info, patterns).items():
        fine = masks[r].block_kinds(128, 128)[s * nq_shard : (s + 1) * nq_shard]
        owned = [kv if kv_major else q for q, kv, *_ in seq]
        assert owned == sorted(owned)
        seen = {(q, kv): chunks[0] for q, kv, chunks, *_ in seq if chunks is not None}
        want = {
            (q, kv): tuple(int(x) for x in fine[q, 2 * kv : 2 * kv + 2])
            for q in range(fine.shape[0]) for kv in range(fine.shape[1] // 2)
            if fine[q, 2 * kv : 2 * kv + 2].any()
        }  # fmt: skip
        assert seen == want
        # Every owned block starts and ends once; one with nothing visible is one step of nothing.
        n_owned = fine.shape[1] // 2 if kv_major else fine.shape[0]
        assert sum(f for *_, f, _ in seq) == n_owned and sum(last for *_, last in seq) == n_owned
        for *_, chunks, first, last in seq:
            if chunks is None:
                assert first and last
    assert np.asarray(info.q_block_base).tolist() == [s * nq_shard for s in range(q_shards)]
    blocks, ids, steps = (
        np.asarray(x) for x in (info.partial_mask_blocks, info.partial_mask_ids, info.steps)
    )
    for r in range(4):
        for s in range(q_shards):
            f = info_lib.unpack(steps[r, s])
            for t in np.nonzero(f["pattern"])[0]:
                if PARTIAL not in patterns[f["pattern"][t] - 1][0]:
                    continue
                gq, kv = s * nq_shard + f["q_block"][t], f["kv_block"][t]
                piece = mask[r, gq * 128 : (gq + 1) * 128, kv * 256 : (kv + 1) * 256]
                np.testing.assert_array_equal(blocks[ids[r, s, t]], piece.T if kv_major else piece)


def test_schedule_shared_by_the_heads_of_a_shard():
    mask = sa.MultiHeadMask([sa.CausalMask(SHAPE)] * 4)
    info, function, patterns = info_lib.process_schedule(mask, (128, 128), head_shards=2, q_seq_shards=1)
    assert info.steps.shape[0] == 2 and info.partial_mask_ids is None and function is not None
    info1, _, patterns = info_lib.process_schedule(mask, (128, 256), block_kv_compute=128)
    # Causal 4 x 3 blocks of two chunks: the full pattern, and the diagonal at either chunk.
    assert info1.steps.shape == (1, 1, 6)
    assert sorted(patterns) == sorted([((PARTIAL, EMPTY),), ((FULL, PARTIAL),), ((FULL, FULL),)])
    # Cells of 128 queries by 128 keys in blocks of 256 x 256: the diagonal block's cells.
    _, _, patterns = info_lib.process_schedule(mask, (256, 256), block_kv_compute=128, q_band=128)
    assert ((PARTIAL, EMPTY), (FULL, PARTIAL)) in patterns and ((FULL, FULL), (FULL, FULL)) in patterns


def chunky_mask(n_q_blocks, chunks, seed=0):
    """Random EMPTY / PARTIAL / FULL 128 x 128 chunks: many distinct step patterns."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 3, (n_q_blocks, chunks))
    kinds[:, 0] = FULL  # every query sees something
    cells = [
        [np.zeros((128, 128), bool), rng.random((128, 128)) < 0.5, np.ones((128, 128), bool)][k]
        for k in kinds.ravel()
    ]
    rows = [np.concatenate(cells[i * chunks : (i + 1) * chunks], axis=1) for i in range(n_q_blocks)]
    return np.concatenate(rows, axis=0)


def test_rare_patterns_become_all_partial():
    """Past MAX_PATTERNS distinct patterns, the rarest are computed as all-PARTIAL."""
    dense = chunky_mask(24, 4)
    mask = sa.MultiHeadMask([sa.NumpyMask(dense)])
    info, _, patterns = info_lib.process_schedule(mask, (128, 512), block_kv_compute=128)
    assert len(patterns) == info_lib.MAX_PATTERNS and ((PARTIAL,) * 4,) in patterns
    codes = info_lib.unpack(np.asarray(info.steps[0, 0]))["pattern"]
    assert len(codes) == 24 and codes.min() >= 1


def test_schedule_errors():
    mask = sa.MultiHeadMask([sa.CausalMask(SHAPE)] * 2)
    with pytest.raises(ValueError, match="q_seq_shards=3 times block_q=128 must divide"):
        info_lib.process_schedule(mask, (128, 128), q_seq_shards=3)
    with pytest.raises(ValueError, match="block_kv=512 must divide"):
        info_lib.process_schedule(mask, (128, 512))
    with pytest.raises(TypeError, match="MultiHeadMask or a boolean NumPy array"):
        info_lib.process_schedule(sa.CausalMask(SHAPE), (128, 128))
    big = sa.MultiHeadMask([sa.FullMask((128, 128 * (info_lib.MAX_BLOCKS + 1)))])
    with pytest.raises(ValueError, match="take larger blocks"):
        info_lib.process_schedule(big, (128, 128))


def test_kernel_is_a_pytree():
    mask = sa.MultiHeadMask([sa.CausalMask((256, 256))] * 2)
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes(128, 128))
    leaves, tree = jax.tree.flatten(kernel)
    again = jax.tree.unflatten(tree, leaves)
    assert isinstance(again, sa.SplashAttentionKernel) and again.kwargs == kernel.kwargs
    np.testing.assert_array_equal(again.fwd_mask_info.steps, kernel.fwd_mask_info.steps)
