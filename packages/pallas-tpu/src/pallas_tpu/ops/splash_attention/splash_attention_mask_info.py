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

The kernels' schedules are ``ScheduleInfo`` from ``process_schedule(_dkv)``. JAX's names
(``MaskInfo``, ``process_mask(_dkv)``, ``process_dynamic_mask(_dkv)``) give JAX's structure
with JAX's meaning, for code written against JAX's splash internals (see the end of the
module).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pallas_tpu.ops.splash_attention import splash_attention_mask as mask_lib

PATTERN_BITS, FIRST_BIT, LAST_BIT, Q_SHIFT, KV_SHIFT = 0b1111, 1 << 4, 1 << 5, 6, 19
MAX_BLOCKS = 1 << 13
MAX_PATTERNS = 15


class ScheduleInfo(NamedTuple):
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


def _check_schedule(
    block_q, block_kv, band, chunk, num_heads, q_len, kv_len, head_shards, q_seq_shards
) -> None:
    """The blocks, cells and shards of a schedule against the mask's shape."""
    if block_q % band:
        raise ValueError(f"splash attention: the band {band} must divide block_q={block_q}")
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


def _step_ids(mask, q, kv, code, patterns, block_shape, kv_major: bool, blocks: dict, contents: list):
    """Per step ``(q[t], kv[t])`` of a walk over a head's ``mask`` (``q``: global block rows),
    the index in ``contents`` of its partial block (each distinct block once: ``blocks`` maps
    its bytes to its index)."""
    block_q, block_kv = block_shape
    partial = np.array([c > 0 and any(mask_lib.PARTIAL in b for b in patterns[c - 1]) for c in code], bool)
    step_ids = np.zeros(len(q), np.int32)
    for t in np.nonzero(partial)[0]:
        piece = np.asarray(
            mask[q[t] * block_q : (q[t] + 1) * block_q, kv[t] * block_kv : (kv[t] + 1) * block_kv],
            dtype=np.int8,
        )
        step_ids[t] = _stored(piece.T if kv_major else piece, blocks, contents)
    # Steps between partial blocks keep naming the last one (no copy); those before the
    # first name the first.
    if partial.any():
        at = np.where(partial, np.arange(len(q)), -1)
        at = np.maximum.accumulate(at)
        at[at < 0] = np.argmax(partial)
        step_ids = step_ids[at]
    return step_ids


def _stored(piece, index: dict, pieces: list) -> int:
    """The index of ``piece`` in ``pieces``, appended if no equal piece is there (``index``:
    each stored piece's bytes to its index)."""
    key = piece.tobytes()
    if key not in index:
        index[key] = len(pieces)
        pieces.append(piece)
    return index[key]


def _process(mask, block_shape, chunk, band, head_shards, q_seq_shards, kv_major: bool):
    """Schedules for every head and q shard: ``(ScheduleInfo of NumPy arrays, kernel function,
    patterns)``; a pattern gives the kinds of a block's cells of ``band`` queries by ``chunk``
    keys, ``pattern[band][chunk]``."""
    block_q, block_kv = (int(b) for b in block_shape)
    chunk = block_kv if chunk is None else int(chunk)
    band = block_q if band is None else int(band)
    heads = _head_masks(mask)
    num_heads = len(heads)
    q_len, kv_len = heads[0].shape
    _check_schedule(block_q, block_kv, band, chunk, num_heads, q_len, kv_len, head_shards, q_seq_shards)
    nq = q_len // block_q
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
            step_ids = _step_ids(
                distinct[u],
                s * nq_shard + q,
                kv,
                code,
                patterns,
                (block_q, block_kv),
                kv_major,
                blocks,
                contents,
            )
            ids[r, s] = np.concatenate([step_ids, np.full(pad, step_ids[-1])])
    partial_blocks = None
    if ids is not None:
        shape = (block_kv, block_q) if kv_major else (block_q, block_kv)
        partial_blocks = np.stack(contents) if contents else np.zeros((1, *shape), np.int8)
    base = (np.arange(q_seq_shards) * nq_shard).astype(np.int32)
    return ScheduleInfo(steps, ids, partial_blocks, base), kernel_function, patterns


def process_schedule(
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
    keys: ``(ScheduleInfo, kernel_function or None, patterns)``.
    ``downcast_smem_data`` is accepted for the signature of ``process_mask``: the steps are
    always packed into one int32 word each."""
    del downcast_smem_data
    return _process(mask, block_shape, block_kv_compute, q_band, head_shards, q_seq_shards, kv_major=False)


def process_schedule_dkv(
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
    accepted for the signature of ``process_mask_dkv`` (the schedule never holds empty
    blocks)."""
    del downcast_smem_data, shrink_grid
    return _process(mask, block_shape, block_kv_compute, q_band, head_shards, q_seq_shards, kv_major=True)


# JAX's mask-info interface.
#
# Code written against JAX's splash internals reads a mask as JAX's kernels do: per grid cell
# ``(head, q block, kv block)`` whether the block is empty, partial or full (``block_mask``),
# which kv (forward, dq) or q (dkv) block to fetch there (``data_next``) and which partial
# block (``mask_next``). The kernels above run on ``ScheduleInfo`` instead; what follows
# computes JAX's structure from the same masks, with JAX's meaning, for such callers.


class MaskInfo(NamedTuple):
    """JAX's sparse form of a mask (``process_mask`` and friends), for code built on it; the
    kernels here use ``ScheduleInfo``.

    Attributes:
      data_next: int ``[heads or head_shards, q_blocks, kv_blocks]``: at each grid cell, the
        block to fetch (kv block; in the dkv form, q block counted within its q shard): that
        of the first non-empty cell at or after it in the kernel's walk, wrapping to the
        first; 0 where the head's shard hides everything.
      mask_next: the same shape: the index into ``partial_mask_blocks`` of the first partial
        cell at or after it (wrapping), or None (no partial block, or a mask function).
      block_mask: the same shape: 0 empty, 1 partial, 2 full.
      partial_mask_blocks: bool ``[n, block_q, block_kv]`` distinct partial blocks in order of
        first appearance (dkv: transposed), or None.
      q_sequence: int32 ``[q_seq_len]`` the query positions the mask function sees, or None.
      is_dynamic_mask: True from ``process_dynamic_mask``.

    The head axis has one row per head shard when every head of a shard has the same mask,
    else one per head. With ``shrink_grid`` and one mask for all heads the block axis the
    kernel sweeps keeps only the non-empty blocks (padding: block 0, repeated indices).
    """

    data_next: np.ndarray | jax.Array | None
    mask_next: np.ndarray | jax.Array | None
    block_mask: np.ndarray | jax.Array | None
    partial_mask_blocks: np.ndarray | jax.Array | None
    q_sequence: np.ndarray | None
    is_dynamic_mask: bool | None = None


def _smallest_int(array: np.ndarray) -> np.ndarray:
    """``array`` (non-negative int32) as the narrowest of int8, int16 and int32 holding it."""
    if array.dtype != np.int32:
        raise ValueError("Expected int32 input.")
    if not np.all(array >= 0):
        raise ValueError("Expected non-negative array.")
    if array.size == 0:
        return array
    top = int(array.max())
    for dtype in (np.int8, np.int16):
        if top <= np.iinfo(dtype).max:
            return array.astype(dtype)
    return array.astype(np.int32)


def _check_layout(shape, block_shape, head_shards: int, q_seq_shards: int) -> tuple[int, ...]:
    """``(heads, q_blocks, kv_blocks, heads per shard, q blocks per shard)``, or JAX's errors."""
    if len(shape) != 3:
        raise ValueError(f"Expected a 3-dim mask, instead got: {tuple(shape)}.")
    heads, q_len, kv_len = (int(n) for n in shape)
    bq, bkv = (int(b) for b in block_shape)
    if q_len % bq:
        raise ValueError(f"q_block_size={bq} should divide q_seq_len={q_len}.")
    if kv_len % bkv:
        raise ValueError(f"kv_block_size={bkv} should divide kv_seq_len={kv_len}.")
    if q_len % q_seq_shards:
        raise ValueError(f"q_seq_shards={q_seq_shards} should divide q_seq_len={q_len}.")
    if (q_len // q_seq_shards) % bq:
        raise ValueError(f"q_block_size={bq} should divide q_seq_len_per_shard={q_len // q_seq_shards}.")
    if heads % head_shards:
        raise ValueError(f"head_shards={head_shards} should divide head_count={heads}.")
    nq = q_len // bq
    return heads, nq, kv_len // bkv, heads // head_shards, nq // q_seq_shards


def _first_at_or_after(flags: np.ndarray, values: np.ndarray) -> np.ndarray:
    """At each position of 1-d ``flags``, ``values`` at the first flagged position at or after
    it (past the last: the first flagged); zeros when nothing is flagged."""
    n = flags.size
    if not flags.any():
        return np.zeros(n, np.int32)
    at = np.where(flags, np.arange(n), n)
    at = np.minimum.accumulate(at[::-1])[::-1]
    at = np.where(at == n, at[0], at)
    return values[at].astype(np.int32)


def _walk_next(flags: np.ndarray, values: np.ndarray, kv_major: bool) -> np.ndarray:
    """``_first_at_or_after`` over ``[rows, q, kv]`` arrays in the kernel's order: row, q, kv
    (forward, dq) or kv, row, q (dkv)."""
    order = (2, 0, 1) if kv_major else (0, 1, 2)
    f, v = flags.transpose(order), values.transpose(order)
    out = _first_at_or_after(f.ravel(), v.ravel()).reshape(f.shape)
    return out.transpose(np.argsort(order))


def _shrink(arrays: list, block_mask_shard: np.ndarray, kv_major: bool) -> list:
    """Keep, per q row (dkv: per kv column), the non-empty cells of ``block_mask_shard``
    ``[q, kv]`` (the first head row's), left-aligned (dkv: bottom-aligned), padded with 0."""
    if kv_major:
        lists = [np.nonzero(col)[0] for col in block_mask_shard.T]
        depth = max(len(x) for x in lists)
        pick = np.stack([np.pad(x, (depth - len(x), 0), constant_values=-1) for x in lists], axis=1)
        take = lambda a: np.take_along_axis(a, np.maximum(pick, 0)[None], axis=1)  # noqa: E731
    else:
        lists = [np.nonzero(row)[0] for row in block_mask_shard]
        depth = max(len(x) for x in lists)
        pick = np.stack([np.pad(x, (0, depth - len(x)), constant_values=-1) for x in lists], axis=0)
        take = lambda a: np.take_along_axis(a, np.maximum(pick, 0)[None], axis=2)  # noqa: E731
    if depth == 0:
        raise ValueError(
            "splash attention: a q shard of the mask hides every block, so its grid cannot shrink "
            "(JAX's process_mask fails an assertion here): pass shrink_grid=False"
        )
    return [None if a is None else np.where(pick[None] >= 0, take(a), 0).astype(a.dtype) for a in arrays]


def _partial_blocks(unique, kinds, bq: int, bkv: int, *, loaded: bool):
    """Per distinct head mask, the ``(nq, nkv)`` index of each partial block in the returned
    list of distinct blocks (nothing gathered unless ``loaded``: the kernel computes them)."""
    block_ids = [np.zeros(k.shape, np.int32) for k in kinds]
    contents: dict[bytes, int] = {}
    pieces: list[np.ndarray] = []
    if loaded:
        for u, m in enumerate(unique):
            for qi, ki in np.argwhere(kinds[u] == mask_lib.PARTIAL):
                piece = np.asarray(m[qi * bq : (qi + 1) * bq, ki * bkv : (ki + 1) * bkv], np.bool_)
                block_ids[u][qi, ki] = _stored(piece, contents, pieces)
    return block_ids, pieces


def _next_tables(
    kinds, block_ids, row_ids, one_per_shard, identical, per_shard, head_shards, q_seq_shards, is_dkv
):
    """JAX's ``data_next`` and ``mask_next``: per head shard (or head) and block, the block
    fetched next and the partial block loaded next."""
    nq, nkv = kinds[0].shape
    nq_shard = nq // q_seq_shards
    shard_rows = (
        [row_ids[:1]]
        if identical
        else [
            row_ids[s : s + 1] if one_per_shard else row_ids[s * per_shard : (s + 1) * per_shard]
            for s in range(head_shards)
        ]
    )
    data_parts, mask_parts = [], []
    for rows in shard_rows:
        data_q, mask_q = [], []
        for qs in range(q_seq_shards):
            part = slice(qs * nq_shard, (qs + 1) * nq_shard)
            k = np.stack([kinds[u][part] for u in rows])
            where = np.stack([block_ids[u][part] for u in rows])
            grid = np.indices(k.shape, dtype=np.int32)
            fetch = grid[1] if is_dkv else grid[2]
            data_q.append(_walk_next(k != 0, fetch, is_dkv))
            mask_q.append(_walk_next(k == mask_lib.PARTIAL, where, is_dkv))
        data_parts.append(np.concatenate(data_q, axis=1))
        mask_parts.append(np.concatenate(mask_q, axis=1))
    mask_next: np.ndarray | None
    if identical:
        data_next = np.broadcast_to(data_parts[0], (head_shards, nq, nkv))
        mask_next = np.broadcast_to(mask_parts[0], (head_shards, nq, nkv))
    else:
        data_next, mask_next = np.concatenate(data_parts), np.concatenate(mask_parts)
    return data_next, mask_next


def _shrunk_grid(block_mask, data_next, mask_next, q_seq_shards: int, is_dkv: bool):
    """``(block_mask, data_next, mask_next)`` with each q shard's grid cut to its visible
    blocks (``_shrink``), the shards padded to one length."""
    nq_shard = block_mask.shape[1] // q_seq_shards
    axis = 1 if is_dkv else 2
    shards: list[list[Any]] = []  # per q shard: block_mask, data_next, mask_next (or None)
    for qs in range(q_seq_shards):
        part = slice(qs * nq_shard, (qs + 1) * nq_shard)
        arrays = [
            block_mask[:, part],
            data_next[:, part],
            None if mask_next is None else mask_next[:, part],
        ]
        shards.append(_shrink(arrays, block_mask[0, part], is_dkv))
    if q_seq_shards > 1:
        size = max(s[0].shape[axis] for s in shards)
        padded: list[list[Any]] = []
        for shard in shards:
            width = [(0, 0)] * 3
            width[axis] = (0, size - shard[0].shape[axis])
            padded.append(
                [np.pad(shard[0], width, constant_values=0)]
                + [None if a is None else np.pad(a, width, mode="edge") for a in shard[1:]]
            )
        shards = padded
    block_mask = np.concatenate([s[0] for s in shards], axis=1)
    data_next = np.concatenate([s[1] for s in shards], axis=1)
    mask_next = None if mask_next is None else np.concatenate([s[2] for s in shards], axis=1)
    return block_mask, data_next, mask_next


def _jax_process_mask(
    mask,
    block_shape: tuple[int, int],
    is_dkv: bool,
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, Any]:
    heads_list = _head_masks(mask)
    per_shard = _check_layout(
        (len(heads_list), *heads_list[0].shape), block_shape, head_shards, q_seq_shards
    )[3]
    bq, bkv = (int(b) for b in block_shape)
    ids: dict[Any, int] = {}
    head_id = [ids.setdefault(m, len(ids)) for m in heads_list]
    unique = list(ids)
    shard_ids = [set(head_id[s * per_shard : (s + 1) * per_shard]) for s in range(head_shards)]
    one_per_shard = all(len(x) == 1 for x in shard_ids)
    row_ids = [head_id[s * per_shard] for s in range(head_shards)] if one_per_shard else head_id

    q_sequence = mask_function = None
    if len(unique) == 1 and hasattr(unique[0], "q_sequence") and hasattr(unique[0], "mask_function"):
        q_sequence, mask_function = unique[0].q_sequence, unique[0].mask_function

    kinds = [np.asarray(m.block_kinds(bq, bkv), np.int32) for m in unique]
    block_ids, pieces = _partial_blocks(unique, kinds, bq, bkv, loaded=mask_function is None)
    has_partial = any((k == mask_lib.PARTIAL).any() for k in kinds)
    partial_mask_blocks = np.stack(pieces).astype(np.bool_) if pieces else None
    if is_dkv and partial_mask_blocks is not None:
        partial_mask_blocks = np.swapaxes(partial_mask_blocks, -1, -2)

    block_mask = np.stack([kinds[u] for u in row_ids]).astype(np.int32)
    identical = one_per_shard and len({head_id[s * per_shard] for s in range(head_shards)}) == 1
    data_next, mask_next = _next_tables(
        kinds, block_ids, row_ids, one_per_shard, identical, per_shard, head_shards, q_seq_shards, is_dkv
    )
    if not has_partial:
        mask_next = None

    if shrink_grid and len(unique) == 1:
        block_mask, data_next, mask_next = _shrunk_grid(
            block_mask, data_next, mask_next, q_seq_shards, is_dkv
        )

    if downcast_smem_data:
        data_next, block_mask = _smallest_int(np.asarray(data_next)), _smallest_int(block_mask)
        mask_next = None if mask_next is None else _smallest_int(np.asarray(mask_next))
    computed = mask_function is not None
    info = MaskInfo(
        data_next=data_next,
        mask_next=None if computed else mask_next,
        block_mask=block_mask,
        partial_mask_blocks=None if computed else partial_mask_blocks,
        q_sequence=q_sequence,
    )
    return info, mask_function


def process_mask(
    mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, Any]:
    """JAX's ``process_mask``: the forward/dq ``MaskInfo`` of ``mask`` (a ``MultiHeadMask``,
    or a boolean NumPy ``[heads, q_seq_len, kv_seq_len]``) in ``block_shape`` blocks, and the
    mask's ``mask_function`` (None unless all heads share one mask that has ``q_sequence``
    and ``mask_function``; then ``mask_next`` and ``partial_mask_blocks`` are None).

    ``data_next`` and ``mask_next`` follow each head shard and q shard's walk (head, q block,
    kv block) separately. Small-integer arrays are int8/int16 where they fit
    (``downcast_smem_data``). Where JAX fails on a grid shrunk over several q shards with no
    partial block, this gives ``mask_next`` None; a shrunk grid with a q shard that hides
    every block raises ValueError (JAX fails an assertion). The kernels here use
    ``process_schedule``."""
    return _jax_process_mask(
        mask,
        block_shape,
        False,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )


def process_mask_dkv(
    mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, Any]:
    """JAX's ``process_mask_dkv``: as ``process_mask`` for the dk/dv kernel, whose walk is kv
    block, head, q block: ``data_next`` names q blocks (counted within the q shard), the
    partial blocks are transposed ``[n, block_kv, block_q]``, and a shrunk grid keeps each
    kv column's non-empty q blocks."""
    return _jax_process_mask(
        mask,
        block_shape,
        True,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )


def _dynamic(mask, block_shape, is_dkv: bool, downcast_smem_data: bool, head_shards: int, q_seq_shards: int):
    import jax.numpy as jnp

    if len(mask.shape) != 3:
        raise ValueError(f"Expected a 3-dim mask, instead got: {tuple(mask.shape)}.")
    if mask.dtype != np.bool_:
        raise ValueError(f"Expected a bool mask, instead got: {mask.dtype}.")
    heads, nq, nkv, per_shard, nq_shard = _check_layout(mask.shape, block_shape, head_shards, q_seq_shards)
    bq, bkv = (int(b) for b in block_shape)
    blocks = jnp.asarray(mask).reshape(heads, nq, bq, nkv, bkv).transpose(0, 1, 3, 2, 4)
    full = jnp.all(blocks, axis=(-1, -2))
    some = jnp.any(blocks, axis=(-1, -2))
    block_mask = jnp.where(full, 2, jnp.where(some, 1, 0)).astype(jnp.int32)
    # Cells counted within each (head shard, q shard) piece: head, q block, kv block.
    h = np.arange(heads)[:, None, None] % per_shard
    q = np.arange(nq)[None, :, None] % nq_shard
    kv = np.arange(nkv)[None, None, :]
    local = ((h * nq_shard + q) * nkv + kv).astype(np.int32)
    mask_next = jnp.where(block_mask == 1, jnp.asarray(local), 0).astype(jnp.int32)
    fetch = np.broadcast_to(q if is_dkv else kv, (heads, nq, nkv)).astype(np.int32)
    data_next = jnp.where(block_mask == 0, 0, jnp.asarray(fetch)).astype(jnp.int32)
    if is_dkv:
        blocks = blocks.swapaxes(-1, -2)

    def narrow(array, top: int):
        if array.size == 0:
            return array
        for dtype in (jnp.int8, jnp.int16):
            if top <= np.iinfo(dtype).max:
                return array.astype(dtype)
        return array

    if downcast_smem_data:
        block_mask = block_mask.astype(jnp.int8)
        data_next = narrow(data_next, nq_shard if is_dkv else nkv)
        mask_next = narrow(mask_next, per_shard * nq_shard * nkv)
    info = MaskInfo(
        data_next=data_next,
        mask_next=mask_next,
        block_mask=block_mask,
        partial_mask_blocks=blocks.astype(jnp.bool_),
        q_sequence=None,
        is_dynamic_mask=True,
    )
    return info, None


def process_dynamic_mask(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, None]:
    """JAX's ``process_dynamic_mask``: the forward/dq ``MaskInfo`` of a boolean
    ``[heads, q_seq_len, kv_seq_len]`` array (traceable: no value is read at trace time) and
    None. Every block is kept: ``partial_mask_blocks`` is the mask tiled
    ``[heads, q_blocks, kv_blocks, block_q, block_kv]``, ``block_mask`` 0/1/2 per block,
    ``data_next`` the block's kv index (0 where empty), ``mask_next`` the block's position
    within its (head shard, q shard) piece, row-major, where partial (else 0).
    ``shrink_grid`` is ignored, as in JAX."""
    del shrink_grid
    return _dynamic(mask, block_shape, False, downcast_smem_data, head_shards, q_seq_shards)


def process_dynamic_mask_dkv(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, None]:
    """JAX's ``process_dynamic_mask_dkv``: as ``process_dynamic_mask`` with ``data_next`` the
    block's q index within its q shard and the tiles transposed ``[..., block_kv, block_q]``."""
    del shrink_grid
    return _dynamic(mask, block_shape, True, downcast_smem_data, head_shards, q_seq_shards)
