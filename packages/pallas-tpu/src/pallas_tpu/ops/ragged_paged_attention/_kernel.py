"""The kernel behind ``ragged_paged_attention`` (``kernel``'s docstring says how it works): the
vector side, a work item's KV blocks through the online softmax, and the ``pallas_call``."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.paged_attention._kernel import weighted_values
from pallas_tpu.ops.ragged_paged_attention._schedule import Copies, Item, Plan, Tables, kv_block_range
from pallas_tpu.ops.ragged_paged_attention._update import write_new_kv
from pallas_tpu.ops.ragged_paged_attention.tuned_block_sizes import get_tuned_block_sizes, query_window

#: The logit of a masked key (JAX's value).
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)

_F32 = jnp.float32
_TRANS_B = (((1,), (1,)), ((), ()))
# KV heads a step of the head loop computes: their strided loads start at a static row past
# a group's first, which is a multiple of every cache dtype's sublane tile (4 heads: 8 rows of
# float32, 4 words of 16-bit pairs, 2 of 8-bit quads).
HEAD_GROUP = 4


def _slot_rows(plan: Plan, buf, slot):
    """A slot as ``[tokens * combined heads, head_dim]`` rows (the buffer keeps the cache's
    trailing dims, whose tiles hold whole tokens)."""
    return buf.at[slot].reshape(plan.block_tokens * plan.kv_heads_combined, plan.head_dim)


def _word_rows(plan: Plan, buf, slot, first_row, step, group=None):
    """Rows ``first_row + step * t`` (t over the block's tokens) of a slot read as 32-bit words,
    past ``group`` (traced) groups of ``HEAD_GROUP`` heads: a window whose start and length
    are multiples of the group's word rows, themselves of the sublane tile (a strided load's
    start must be static unless it is a tile multiple)."""
    view = _slot_rows(plan, buf, slot)
    if plan.kv_dtype.itemsize < 4:
        view = view.bitcast(jnp.uint32)
    if group is not None:  # the window ends at the last token's row of the last group at most
        words = step * HEAD_GROUP // plan.num_kv_heads  # a group's word rows in a token
        view = view.at[pl.ds(pl.multiple_of(group * words, words), view.shape[0] - step + words)]
    return view[pl.ds(first_row, plan.block_tokens, stride=step), :]


def _from_byte(bits, dtype):
    """The float32 values of 8-bit codes held in the low byte of uint32 ``bits``."""
    if dtype == np.dtype(jnp.int8):
        return ((bits ^ 0x80).astype(jnp.int32) - 0x80).astype(_F32)
    if dtype == np.dtype(jnp.float8_e5m2):  # the top byte of a float16
        half = bits.astype(jnp.uint32) << 8
        sign, mag = (half >> 15) << 31, half & 0x7FFF
        exp, man = mag >> 10, mag & 0x3FF
        normal = lax.bitcast_convert_type(((exp + 112) << 23) | (man << 13), _F32)
        special = lax.bitcast_convert_type(jnp.uint32(0x7F800000) | (man << 13), _F32)  # inf, NaN
        sub = man.astype(_F32) * np.float32(2.0**-24)
        val = jnp.where(exp == 0, sub, jnp.where(exp == 31, special, normal))
        return lax.bitcast_convert_type(lax.bitcast_convert_type(val, jnp.uint32) | sign, _F32)
    if dtype == np.dtype(jnp.float8_e4m3fn):
        sign = (bits >> 7) << 31
        exp, man = (bits >> 3) & 0xF, bits & 0x7
        normal = lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), _F32)
        sub = man.astype(_F32) * np.float32(2.0**-9)
        val = jnp.where(exp == 0, sub, normal)
        val = jnp.where((exp == 15) & (man == 7), np.float32(np.nan), val)
        return lax.bitcast_convert_type(lax.bitcast_convert_type(val, jnp.uint32) | sign, _F32)
    raise NotImplementedError(f"ragged_paged_attention: KV pages of {dtype}")


def _head_kv(plan: Plan, buf, slot, h, group=None):
    """The keys and values of KV head ``h`` (static) in a slot, of head group ``group`` (traced:
    heads ``HEAD_GROUP * group + h``) if given, ``[block_tokens, head_dim]`` each, as float32
    (exact) or the compute dtype. A token's combined heads alternate K and V, so the K and V of
    one head share a 32-bit word for 16-bit caches (low half K) and for 8-bit ones (bytes
    2(h%2) and 2(h%2)+1 of word h//2): one strided load gives both."""
    size = plan.kv_dtype.itemsize
    heads = plan.kv_heads_combined
    if size == 4:
        k = _word_rows(plan, buf, slot, 2 * h, heads, group)
        v = _word_rows(plan, buf, slot, 2 * h + 1, heads, group)
    elif size == 2:
        w = _word_rows(plan, buf, slot, h, heads // 2, group)
        k = lax.bitcast_convert_type(w << 16, _F32)
        v = lax.bitcast_convert_type(w & np.uint32(0xFFFF0000), _F32)
    else:
        w = _word_rows(plan, buf, slot, h // 2, heads // 4, group) >> (16 * (h % 2))
        k = _from_byte(w & 0xFF, plan.kv_dtype)
        v = _from_byte((w >> 8) & 0xFF, plan.kv_dtype)
    # ``k_scale`` and ``v_scale`` are applied to the scores and the output, not here: the codes
    # (8-bit, or the cache's own floats) are exact in the compute dtype.
    return k.astype(plan.compute_dtype), v.astype(plan.compute_dtype)


def _row_tokens(plan: Plan, shape):
    """The block-relative token of each score row (rows are (token, group) pairs)."""
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    g = plan.groups
    if g & (g - 1) == 0:
        return r >> (g.bit_length() - 1)
    return ((r.astype(_F32) + 0.5) * (1.0 / g)).astype(jnp.int32)


def _attend_block(plan: Plan, refs, item: Item, j, slot, t0, tokens):
    """One KV block against the rows of query tokens ``[t0, t0 + tokens)`` of the step, every
    KV head; rows outside the item's are fully masked (their state is wiped by their own item:
    a masked row's weights meet ``exp(mask_value - m) == 0`` once it sees a real key)."""
    q_ref, buf, m_ref, l_ref, acc_ref = refs
    rows = tokens * plan.groups
    r0 = t0 * plan.groups if isinstance(t0, int) else pl.multiple_of(t0 * plan.groups, rows)
    shape = (rows, plan.block_tokens)
    tok = t0 + _row_tokens(plan, shape)
    rel = j * plan.block_tokens + lax.broadcasted_iota(jnp.int32, shape, 1) - tok  # key pos - token
    valid = (rel <= item.pos_base) & (tok >= item.row_lo) & (tok < item.row_hi)
    if plan.sliding_window is not None:
        valid &= rel > item.pos_base - plan.sliding_window

    def head(h, group=None):
        k, v = _head_kv(plan, buf, slot, h, group)
        if group is not None:
            h = group * HEAD_GROUP + h
        q = q_ref[h, pl.ds(r0, rows), :].astype(plan.compute_dtype)
        s = lax.dot_general(q, k, _TRANS_B, preferred_element_type=_F32)
        # One float32 multiply a score: sm_scale and k_scale (and 1 / soft_cap) on the float32
        # scores, never on q before the matmul (a 16-bit q rounded after scaling loses up to
        # 2**-9 of every logit, which a sharp softmax turns into large output errors).
        scale = plan.sm_scale * (1.0 if plan.k_scale is None else plan.k_scale)
        if plan.soft_cap is not None:
            s = jnp.tanh(s * (scale / plan.soft_cap)) * plan.soft_cap
        elif scale != 1.0:
            s = s * scale
        s = jnp.where(valid, s, plan.mask_value)
        m_prev, l_prev = m_ref[h, pl.ds(r0, rows), :], l_ref[h, pl.ds(r0, rows), :]
        m = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m)
        p = jnp.exp(s - m)
        m_ref[h, pl.ds(r0, rows), :] = m
        l_ref[h, pl.ds(r0, rows), :] = alpha * l_prev + p.sum(axis=1, keepdims=True)
        pv = weighted_values(p, v)
        acc_ref[h, pl.ds(r0, rows), :] = alpha * acc_ref[h, pl.ds(r0, rows), :] + pv

    # Groups of HEAD_GROUP heads in a loop, each group's heads static (the kernel's code does
    # not grow with the KV heads); a single group, or heads not in whole groups, static.
    groups = plan.num_kv_heads // HEAD_GROUP
    groups = groups if groups > 1 and plan.num_kv_heads % HEAD_GROUP == 0 else 0
    if groups:

        def group(g, carry):
            for h in range(HEAD_GROUP):
                head(h, g)
            return carry

        lax.fori_loop(0, groups, group, 0)
    for h in range(groups * HEAD_GROUP, plan.num_kv_heads):
        head(h)


def plan_for(q_dtype, kv_dtype, tokens, num_q_heads, num_kv_heads, head_dim, page_size, page_table, blocks,
             sliding_window, soft_cap, mask_value, k_scale, v_scale, **v3) -> Plan:  # fmt: skip
    """The static facts of a call: ``page_table`` is ``(max_num_seqs, pages_per_seq)``; ``blocks``
    ``(num_kv_pages_per_block, num_queries_per_block)`` as given (None: ``get_tuned_block_sizes``'),
    the queries rounded up to the narrow path's window; ``v3``: ``Plan``'s fields of v3."""
    max_num_seqs, pages_per_seq = page_table
    pages, queries = blocks
    if pages is None or queries is None:
        tuned = get_tuned_block_sizes(q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size, tokens,
                                      pages_per_seq, info=pltpu.get_tpu_info())  # fmt: skip
        pages, queries = pages or tuned[0], queries or tuned[1]
    groups = num_q_heads // num_kv_heads
    window = query_window(groups)
    kv_dtype = np.dtype(kv_dtype)
    # 8-bit codes are exact in any float q dtype
    compute = np.dtype(q_dtype) if kv_dtype.itemsize == 1 else np.dtype(jnp.promote_types(q_dtype, kv_dtype))
    return Plan(
        num_kv_heads=num_kv_heads, groups=groups, head_dim=head_dim, page_size=page_size,
        pages_per_seq=pages_per_seq, pages_per_block=int(pages), q_block=-(-int(queries) // window) * window,
        window=window, max_num_seqs=max_num_seqs, kv_dtype=kv_dtype, compute_dtype=compute,
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        mask_value=float(DEFAULT_MASK_VALUE if mask_value is None else mask_value), k_scale=k_scale,
        v_scale=v_scale, **v3,
    )  # fmt: skip


class _Operands:
    """The kernel's refs by name. Operands: q, then the cache (read only), or the new K/V and
    the cache (written, then read through its aliased output); the sink tile; the output (and
    the updated cache); the scratch."""

    def __init__(self, plan: Plan, q_ref, refs):
        self.q_ref = q_ref
        rest = list(refs)
        self.new_ref = None
        if plan.update_cache:
            self.new_ref = rest.pop(0)
            rest.pop(0)  # the cache's input: read and written through its aliased output
        else:
            self.kv_hbm = rest.pop(0)
        self.sink_ref = rest.pop(0) if plan.attention_sink else None
        self.o_ref = rest.pop(0)
        if plan.update_cache:
            self.kv_hbm = rest.pop(0)
        self.scratch = rest
        self.buf, self.sems, self.m_ref, self.l_ref, self.acc_ref, self.state = rest[:6]


def _first_step(plan: Plan, ops: _Operands, tables: Tables):
    if plan.update_cache:  # every new token is in its page before any page is read
        write_new_kv(plan, tables, ops.new_ref, ops.kv_hbm, ops.scratch[6].at[0])
    # Skipped pages leave slots stale: zeros (then real pages) keep NaN out of p @ v.
    for slot in range(2):
        rows = _slot_rows(plan, ops.buf, slot)
        rows[...] = jnp.zeros(rows.shape, rows.dtype)
    state = ops.state
    state[0] = 0  # the slot the next item's first KV block is in
    state[1] = 0  # whether the previous step started this step's first item
    state[2] = 0  # the first sequence that may have rows in this step


def _start_rows(plan: Plan, ops: _Operands):
    """The online softmax's state of every row of the step, before its first key."""
    m_ref, l_ref = ops.m_ref, ops.l_ref
    if plan.attention_sink:  # the sink: a key of logit sink[h] and value 0 in every softmax
        m_ref[...] = cast(Any, ops.sink_ref)[...]  # an operand with plan.attention_sink
        l_ref[...] = jnp.ones(l_ref.shape, _F32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    ops.acc_ref[...] = jnp.zeros(ops.acc_ref.shape, _F32)


def _one_sequence(plan: Plan, ops: _Operands, tables: Tables, copies: Copies, i, blocks, carry):
    """A work item (sequence ``s`` in query block ``i``): its KV blocks, each one's copy started
    while the one before is computed, the next item's first block started after its last."""
    s, _, slot = carry
    refs = (ops.q_ref, ops.buf, ops.m_ref, ops.l_ref, ops.acc_ref)
    item = tables.item(s, i)
    # The item after this one: the next sequence in this block, else the first of the next.
    ns, here = tables.first_item(s + 1, i)
    ns2, there = tables.first_item(s, i + 1)
    there &= (i + 1 < blocks) & jnp.logical_not(here)
    nxt_i = jnp.where(here, i, i + 1)
    nxt = tables.item(jnp.where(here, ns, ns2), nxt_i)
    lo, hi = kv_block_range(plan, item)

    def run(t0, tokens):
        def kv_block(j, slot):
            @pl.when(j + 1 < hi)
            def _():
                copies.start(item, j + 1, 1 - slot)

            @pl.when((j + 1 == hi) & (here | there))
            def _():
                copies.start(nxt, kv_block_range(plan, nxt)[0], 1 - slot)
                ops.state[1] = there.astype(jnp.int32)

            copies.wait(item, j, slot)
            _attend_block(plan, refs, item, j, slot, t0, tokens)
            return 1 - slot

        return lax.fori_loop(lo, hi, kv_block, slot)

    w = plan.window
    t0 = (item.row_lo // w) * w
    if plan.q_block > w:
        narrow = item.row_hi <= t0 + w
        slot = lax.cond(narrow, lambda: run(pl.multiple_of(t0, w), w), lambda: run(0, plan.q_block))
    else:
        slot = run(0, plan.q_block)
    return jnp.where(here, ns, s), here, slot


def _finish(plan: Plan, ops: _Operands, h, carry):
    """Head ``h``'s rows normalized (a row that saw no key: zeros) into the output."""
    l = ops.l_ref[h]
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    if plan.v_scale is not None:
        inv = inv * plan.v_scale
    ops.o_ref[h] = (ops.acc_ref[h] * inv).astype(ops.o_ref.dtype)
    return carry


def _kernel(plan: Plan, kv_lens, page_indices, cu_q_lens, num_seqs, q_ref, *refs):
    ops = _Operands(plan, q_ref, refs)
    i, blocks = pl.program_id(0), pl.num_programs(0)
    tables = Tables(plan, kv_lens, page_indices, cu_q_lens, num_seqs)
    copies = Copies(plan, tables, ops.kv_hbm, ops.buf, ops.sems)
    state = ops.state
    pl.when(i == 0)(lambda: _first_step(plan, ops, tables))
    _start_rows(plan, ops)
    s0, found = tables.first_item(state[2], i)

    @pl.when(found & (state[1] == 0))
    def _():
        item = tables.item(s0, i)
        copies.start(item, kv_block_range(plan, item)[0], state[0])

    state[1] = 0
    body = lambda carry: _one_sequence(plan, ops, tables, copies, i, blocks, carry)
    last, _, slot = lax.while_loop(lambda c: c[1], body, (s0, found, state[0]))
    state[0] = slot
    state[2] = jnp.where(found, last, state[2])
    lax.fori_loop(0, plan.num_kv_heads, lambda h, carry: _finish(plan, ops, h, carry), 0)


def call(
    plan: Plan, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, vmem_limit_bytes, interpret,
    *, new_kv=None, sink=None, out_dtype=None,
):  # fmt: skip
    """The ``pallas_call`` of ``plan``: the output (``q``'s shape, ``out_dtype`` or ``q``'s
    dtype). With ``plan.update_cache``, ``new_kv`` (``[tokens, ...]``: ``kv_pages``' trailing dims, of
    the cache's dtype) is written into ``kv_pages`` (aliased), and ``(output, updated cache)``
    come back; ``sink``: float32 ``[num_q_heads]`` with ``plan.attention_sink``."""
    tokens, num_q_heads, head_dim = q.shape
    hkv, g, bq = plan.num_kv_heads, plan.groups, plan.q_block
    padded = pl.cdiv(tokens, bq) * bq
    # Rows of a KV head's score tile are (token, group) pairs: [kv heads, tokens * groups, head_dim].
    plan = dataclasses.replace(plan, sm_scale=float(sm_scale))  # applied to the float32 scores
    qs = jnp.pad(q, ((0, padded - tokens), (0, 0), (0, 0)))
    qh = qs.reshape(padded, hkv, g, head_dim).transpose(1, 0, 2, 3).reshape(hkv, padded * g, head_dim)
    # The cache stays in its own shape ([pages, page_size, ...tail]): no relayout around the call.
    tail = kv_pages.shape[2:]
    rows = bq * g
    spec = pl.BlockSpec((hkv, rows, head_dim), lambda i, *_: (0, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    slot_rows = plan.pages_per_block * plan.page_rows
    scratch = [
        pltpu.VMEM((2, plan.block_tokens, *tail), kv_pages.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((hkv, rows, 1), _F32),
        pltpu.VMEM((hkv, rows, 1), _F32),
        pltpu.VMEM((hkv, rows, head_dim), _F32),
        pltpu.SMEM((3,), jnp.int32),
    ]
    out_dtype = np.dtype(out_dtype or q.dtype)
    operands, in_specs = [qh], [spec]
    out_shape, out_specs = [jax.ShapeDtypeStruct(qh.shape, out_dtype)], [spec]
    aliases = {}
    if plan.update_cache:
        operands += [new_kv.reshape(tokens, *tail), kv_pages]
        in_specs += [hbm, hbm]
        out_shape.append(jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype))
        out_specs.append(hbm)
        aliases = {4 + 2: 1}  # JAX's convention: operands counted with the scalar tables
        scratch.append(pltpu.SemaphoreType.DMA((1,)))
    else:
        operands.append(kv_pages)
        in_specs.append(hbm)
    if plan.attention_sink:
        tile = jnp.broadcast_to(sink.astype(_F32).reshape(hkv, 1, g), (hkv, bq, g)).reshape(hkv, rows, 1)
        operands.append(tile)
        in_specs.append(pl.BlockSpec((hkv, rows, 1), lambda i, *_: (0, 0, 0)))
    if vmem_limit_bytes is None:
        lanes = -(-head_dim // 128) * 128
        need = 2 * slot_rows * lanes * kv_pages.dtype.itemsize
        need += hkv * rows * (4 * lanes * q.dtype.itemsize + 4 * lanes + 4 * 128 * 4)
        need += 8 * rows * plan.block_tokens * 4  # scores, probabilities, masks of one head
        vmem_limit_bytes = _policy.vmem_limit("ragged_paged_attention", need)
    outs = pl.pallas_call(
        lambda *refs: _kernel(plan, *refs),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(padded // bq,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes
        ),
        input_output_aliases=aliases,
        interpret=interpret,
        name="ragged_paged_attention_v3" if plan.update_cache else "ragged_paged_attention",
    )(kv_lens, page_indices.reshape(-1), cu_q_lens, num_seqs, *operands)
    out = outs[0].reshape(hkv, padded, g, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(padded, num_q_heads, head_dim)[:tokens]
    if plan.update_cache:
        return out, outs[1]
    return out
