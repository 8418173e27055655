"""From a splash attention mask to the kernels' schedules of non-empty blocks.

A kernel's grid is ``(heads, q shards, steps)``. Each step visits one ``(q block, kv block)``
pair that the mask does not wholly hide; the pairs of one head and q shard are listed in the
order the kernel walks them (the forward and ``dq`` kernels: q block by q block, the kv blocks
of each in order; the ``dk``/``dv`` kernel: kv block by kv block), so blocks the mask hides
take no grid step, no copy and no compute at all. A step is one packed int32 word, read from
SMEM (scalar prefetch) by the kernel body and by the index maps, which thus copy exactly the
blocks of the steps:

    bits 0-3   pattern: 0 (nothing to compute) or 1 + an index into the schedule's patterns
    bit  4     first: the first step of its owned block (the accumulators start here)
    bit  5     last: the last step of its owned block (the result is written here)
    bits 6-18  the q block, counted within the q shard
    bits 19-31 the kv block

A kv block is computed in chunks of ``block_kv_compute`` keys, and a step's pattern says of
each chunk whether it is EMPTY (skipped), PARTIAL (masked) or FULL (no mask arithmetic). The
patterns that occur (a handful: a causal mask has the all-FULL one and one per place of the
diagonal) are static: the kernel has one straight-line body per pattern, so that the scheduler
overlaps one chunk's matmuls with the next one's softmax. Past ``MAX_PATTERNS`` the rarest are
computed as all-PARTIAL (a masked chunk whose rows all see nothing adds nothing to rows that
see something elsewhere).

An owned block (a q block; ``dk``/``dv``: a kv block) that the mask hides entirely still gets
one step of pattern 0 with both flags, so that its output is written (zeros). Lists shorter
than the longest are padded with copies of their last step, pattern 0 and no flags: the same
blocks named again (no copy), nothing done.

Masks that are the same for every head of a head shard are scheduled once per shard; else
once per head. Partial chunks are computed in the kernel from the mask's ``kernel_function``
when it has one, else read from materialized (deduplicated) ``partial_mask_blocks``, one per
step with a partial chunk, named per step by ``partial_mask_ids``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pallas_tpu.ops.splash_attention import splash_attention_mask as mask_lib

PATTERN_BITS, FIRST_BIT, LAST_BIT, Q_SHIFT, KV_SHIFT = 0b1111, 1 << 4, 1 << 5, 6, 19
MAX_BLOCKS = 1 << 13
MAX_PATTERNS = 15


class MaskInfo(NamedTuple):
    """The schedule of one kernel (forward, ``dq`` or ``dk``/``dv``), as device arrays.

    Attributes:
      steps: int32 ``[mask_heads, q_shards, num_steps]`` packed steps (see the module).
        ``mask_heads`` is ``heads`` when the heads of a shard have different masks, else
        ``head_shards``.
      partial_mask_ids: int32, the same shape: the block of ``partial_mask_blocks`` each step
        reads (None when the kernel computes its partial blocks).
      partial_mask_blocks: int8 ``[num_partial, rows, cols]`` distinct partial blocks (rows are
        queries; in the ``dk``/``dv`` schedule rows are keys), or None.
      q_block_base: int32 ``[q_shards]``: the first q block of each shard (the global query
        positions the kernel's mask function sees).
    """

    steps: np.ndarray | jax.Array
    partial_mask_ids: np.ndarray | jax.Array | None
    partial_mask_blocks: np.ndarray | jax.Array | None
    q_block_base: np.ndarray | jax.Array


def unpack(word) -> dict[str, Any]:
    """The fields of packed steps (NumPy arrays or traced int32 scalars)."""
    return dict(
        pattern=word & PATTERN_BITS,
        first=(word & FIRST_BIT) != 0,
        last=(word & LAST_BIT) != 0,
        q_block=(word >> Q_SHIFT) & (MAX_BLOCKS - 1),
        kv_block=(word >> KV_SHIFT) & (MAX_BLOCKS - 1),
    )


def _head_masks(mask) -> list:
    if isinstance(mask, mask_lib.MultiHeadMask):
        return list(mask.masks)
    if isinstance(mask, np.ndarray) and mask.ndim == 3:
        return [mask_lib.NumpyMask(m.astype(np.bool_)) for m in mask]
    raise TypeError(
        f"splash attention: the mask must be a MultiHeadMask or a boolean NumPy array "
        f"[heads, q_seq_len, kv_seq_len], got {type(mask).__name__}"
    )


def _unique(masks: list) -> tuple[list, list[int]]:
    """The distinct masks and each head's index among them."""
    distinct: list[Any] = []
    index: list[int] = []
    for m in masks:
        for u, d in enumerate(distinct):
            if d is m or (type(d) is type(m) and hash(d) == hash(m) and d == m):
                index.append(u)
                break
        else:
            index.append(len(distinct))
            distinct.append(m)
    return distinct, index


def _owned_walk(kinds: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``[n, 4]`` rows ``(owned, swept, pattern code, flags)`` of one shard's ``[owned, swept]``
    block kinds, owned-major; an owned block with nothing visible gets one step of code 0."""
    visible = kinds != mask_lib.EMPTY
    empty_rows = ~visible.any(axis=1)
    marked = visible.copy()
    marked[empty_rows, 0] = True
    owned, swept = np.nonzero(marked)
    code = codes[owned, swept].astype(np.int64)
    code[empty_rows[owned]] = 0
    first = np.ones(len(owned), bool)
    first[1:] = owned[1:] != owned[:-1]
    last = np.ones(len(owned), bool)
    last[:-1] = owned[1:] != owned[:-1]
    # An empty owned block names the swept block of the step before it (no new copy).
    for at in np.nonzero(empty_rows[owned])[0]:
        swept[at] = swept[at - 1] if at else 0
    flags = np.where(first, FIRST_BIT, 0) | np.where(last, LAST_BIT, 0)
    return np.stack([owned, swept, code, flags], axis=1)


def _pack(q_block, kv_block, code, flags) -> np.ndarray:
    word = (np.asarray(kv_block, np.int64) << KV_SHIFT) | (np.asarray(q_block, np.int64) << Q_SHIFT)
    word = word | flags | code
    return np.where(word >= 1 << 31, word - (1 << 32), word).astype(np.int32)


def _cell_kinds(mask, block_q, block_kv, band, chunk):
    """``(block kinds [nq, nkv], cell kinds [nq, nkv, bands, chunks])``: a block's cells are
    ``band`` queries by ``chunk`` keys."""
    fine = mask.block_kinds(band, chunk)
    nb, nc = block_q // band, block_kv // chunk
    nq, nkv = fine.shape[0] // nb, fine.shape[1] // nc
    cells = fine.reshape(nq, nb, nkv, nc).transpose(0, 2, 1, 3)
    kinds = np.where(
        (cells == mask_lib.FULL).all((-1, -2)),
        mask_lib.FULL,
        np.where((cells != mask_lib.EMPTY).any((-1, -2)), mask_lib.PARTIAL, mask_lib.EMPTY),
    )
    return kinds.astype(np.int8), cells


def _as_pattern(cells) -> tuple:
    return tuple(tuple(int(k) for k in band) for band in cells)


def _pattern_table(fines: list[np.ndarray], kinds: list[np.ndarray]):
    """The distinct cell patterns of the visible blocks (most frequent first, at most
    ``MAX_PATTERNS``; the rest become all-PARTIAL) and each block's code (0: none)."""
    counts: dict[tuple, int] = {}
    for fine, kind in zip(fines, kinds):
        rows = fine[kind != mask_lib.EMPTY]
        if not len(rows):  # a mask that hides everything: no pattern
            continue
        found, n = np.unique(rows.reshape(len(rows), -1), axis=0, return_counts=True)
        for r, c in zip(found, n):
            key = _as_pattern(r.reshape(fine.shape[-2:]))
            counts[key] = counts.get(key, 0) + int(c)
    order = sorted(counts, key=lambda r: -counts[r])
    nb, nc = fines[0].shape[-2:]
    catch_all = ((mask_lib.PARTIAL,) * nc,) * nb
    if len(order) > MAX_PATTERNS:
        order = order[: MAX_PATTERNS - 1]
        if catch_all not in order:
            order.append(catch_all)
    table = tuple(order)
    index = {p: i + 1 for i, p in enumerate(table)}
    codes = []
    for fine, kind in zip(fines, kinds):
        code = np.zeros(kind.shape, np.int64)
        for at in zip(*np.nonzero(kind != mask_lib.EMPTY)):
            code[at] = index.get(_as_pattern(fine[at]), index.get(catch_all, 0))
        codes.append(code)
    return table, codes


def _process(mask, block_shape, chunk, band, head_shards, q_seq_shards, kv_major: bool):
    """Schedules for every head and q shard: ``(MaskInfo of NumPy arrays, kernel function,
    patterns)``; a pattern gives the kinds of a block's cells of ``band`` queries by ``chunk``
    keys, ``pattern[band][chunk]``."""
    block_q, block_kv = (int(b) for b in block_shape)
    chunk = block_kv if chunk is None else int(chunk)
    band = block_q if band is None else int(band)
    if block_q % band:
        raise ValueError(f"splash attention: the band {band} must divide block_q={block_q}")
    heads = _head_masks(mask)
    num_heads = len(heads)
    q_len, kv_len = heads[0].shape
    if head_shards < 1 or num_heads % head_shards:
        raise ValueError(
            f"splash attention: head_shards={head_shards} must divide the mask's heads ({num_heads})"
        )
    if q_seq_shards < 1 or q_len % (q_seq_shards * block_q):
        raise ValueError(
            f"splash attention: q_seq_shards={q_seq_shards} times block_q={block_q} must divide "
            f"q_seq_len={q_len}"
        )
    if kv_len % block_kv or block_kv % chunk:
        raise ValueError(
            f"splash attention: block_kv={block_kv} must divide kv_seq_len={kv_len}, and the compute "
            f"chunk {chunk} block_kv"
        )
    nq, nkv = q_len // block_q, kv_len // block_kv
    if max(nq, nkv) > MAX_BLOCKS:
        raise ValueError(
            f"splash attention: {max(nq, nkv)} blocks along a sequence, more than {MAX_BLOCKS}: take larger blocks"
        )
    distinct, head_index = _unique(heads)
    split = [_cell_kinds(m, block_q, block_kv, band, chunk) for m in distinct]
    kinds = [k for k, _ in split]
    patterns, codes = _pattern_table([f for _, f in split], kinds)
    functions = [m.kernel_function for m in distinct]
    kernel_function = functions[0] if len(distinct) == 1 else None

    per_shard = num_heads // head_shards
    shared = all(len(set(head_index[s * per_shard : (s + 1) * per_shard])) == 1 for s in range(head_shards))
    rows = [head_index[s * per_shard] for s in range(head_shards)] if shared else head_index
    nq_shard = nq // q_seq_shards

    walks = {}
    for u in set(rows):
        for s in range(q_seq_shards):
            part = slice(s * nq_shard, (s + 1) * nq_shard)
            if kv_major:
                kv, q, code, flags = _owned_walk(kinds[u][part].T, codes[u][part].T).T
            else:
                q, kv, code, flags = _owned_walk(kinds[u][part], codes[u][part]).T
            walks[u, s] = (q, kv, code, flags)
    num_steps = max(len(w[0]) for w in walks.values())
    steps = np.zeros((len(rows), q_seq_shards, num_steps), np.int32)
    ids = np.zeros_like(steps) if kernel_function is None else None
    blocks: dict[bytes, int] = {}
    contents: list[Any] = []
    for r, u in enumerate(rows):
        for s in range(q_seq_shards):
            q, kv, code, flags = walks[u, s]
            pad = num_steps - len(q)
            words = _pack(q, kv, code, flags)
            steps[r, s] = np.concatenate([words, np.full(pad, _pack(q[-1], kv[-1], 0, 0))])
            if ids is None:
                continue
            partial = np.array(
                [c > 0 and any(mask_lib.PARTIAL in b for b in patterns[c - 1]) for c in code], bool
            )
            step_ids = np.zeros(len(q), np.int32)
            for t in np.nonzero(partial)[0]:
                gq = s * nq_shard + q[t]
                piece = np.asarray(
                    distinct[u][gq * block_q : (gq + 1) * block_q, kv[t] * block_kv : (kv[t] + 1) * block_kv],
                    dtype=np.int8,
                )
                piece = piece.T if kv_major else piece
                key = piece.tobytes()
                if key not in blocks:
                    blocks[key] = len(contents)
                    contents.append(piece)
                step_ids[t] = blocks[key]
            # Steps between partial blocks keep naming the last one (no copy); those before the
            # first name the first.
            if partial.any():
                at = np.where(partial, np.arange(len(q)), -1)
                at = np.maximum.accumulate(at)
                at[at < 0] = np.argmax(partial)
                step_ids = step_ids[at]
            ids[r, s] = np.concatenate([step_ids, np.full(pad, step_ids[-1])])
    partial_blocks = None
    if ids is not None:
        shape = (block_kv, block_q) if kv_major else (block_q, block_kv)
        partial_blocks = np.stack(contents) if contents else np.zeros((1, *shape), np.int8)
    base = (np.arange(q_seq_shards) * nq_shard).astype(np.int32)
    return MaskInfo(steps, ids, partial_blocks, base), kernel_function, patterns


def process_mask(
    mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    block_kv_compute: int | None = None,
    q_band: int | None = None,
):
    """The q-major schedule (forward and ``dq`` kernels) of ``mask`` in ``(block_q, block_kv)``
    blocks, computed in cells of ``q_band`` queries (default: the block) by ``block_kv_compute``
    keys: ``(MaskInfo, kernel_function or None, patterns)`` (JAX's returns the first two).
    ``downcast_smem_data`` is accepted for JAX's signature: the steps are always packed into one
    int32 word each."""
    del downcast_smem_data
    return _process(mask, block_shape, block_kv_compute, q_band, head_shards, q_seq_shards, kv_major=False)


def process_mask_dkv(
    mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
    block_kv_compute: int | None = None,
    q_band: int | None = None,
):
    """The kv-major schedule (``dk``/``dv`` kernel) of ``mask`` in ``(block_q, block_kv)``
    blocks, computed in cells of ``q_band`` queries (default: the block) by ``block_kv_compute``
    keys; partial blocks are stored transposed ``(block_kv, block_q)``. ``shrink_grid`` is
    accepted for JAX's signature (the schedule never holds empty blocks)."""
    del downcast_smem_data, shrink_grid
    return _process(mask, block_shape, block_kv_compute, q_band, head_shards, q_seq_shards, kv_major=True)
