"""The kernel behind ``paged_attention``: the DMA schedule of the pages and the online softmax
(``paged_attention_kernel``'s docstring says how it works)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

_F32 = jnp.float32
_TRANS_B = (((1,), (1,)), ((), ()))
_INV_MAX_INT8 = 1.0 / 127.5


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static facts of one ``paged_attention`` call."""

    batch: int
    num_kv_heads: int
    groups: int  # q heads per KV head: the rows of a score tile
    head_dim: int
    page_size: int
    pages_per_sequence: int
    pages_per_block: int
    cores: int  # the leading "parallel" grid axis
    split: str | None  # what the cores split: "batch", "kv_head" or None
    quantized: bool
    mask_value: float
    soft_cap: float | None
    compute_dtype: np.dtype  # of the two matmuls' operands

    @property
    def block_tokens(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def steps_b(self) -> int:
        return self.batch // self.cores if self.split == "batch" else self.batch

    @property
    def steps_h(self) -> int:
        return self.num_kv_heads // self.cores if self.split == "kv_head" else self.num_kv_heads

    def seq_head(self, c, bi, hi):
        """The sequence and KV head of grid step ``(c, bi, hi)``: a core takes a contiguous half."""
        b = c * self.steps_b + bi if self.split == "batch" else bi
        h = c * self.steps_h + hi if self.split == "kv_head" else hi
        return b, h

    def num_pages(self, length):
        """Pages holding ``length`` keys (the page table's width at most)."""
        return jnp.minimum(pl.cdiv(length, self.page_size), self.pages_per_sequence)

    def block_pages(self, j, length):
        """How many pages block ``j`` of a sequence of ``length`` keys copies."""
        return jnp.minimum(self.pages_per_block, self.num_pages(length) - j * self.pages_per_block)


class _Copies:
    """The DMAs of a (sequence, KV head)'s pages into one slot of the double buffers: every array
    (K, V, and their scales when quantized) moves the same pages, each on its own semaphore."""

    def __init__(self, plan: Plan, pages_ref, hbm, bufs, sems):
        self.plan, self.pages_ref, self.hbm, self.bufs, self.sems = plan, pages_ref, hbm, bufs, sems

    def _page(self, h, page, slot, i):
        for a, (src, buf) in enumerate(zip(self.hbm, self.bufs)):
            pltpu.make_async_copy(src.at[h, page], buf.at[slot, i], self.sems.at[a, slot]).start()

    def start(self, b, h, j, slot, length):
        """Starts block ``j`` of sequence ``b``: unrolled when it is full, a loop when it is the
        short last one."""
        n = self.plan.pages_per_block
        count = self.plan.block_pages(j, length)
        base = b * self.plan.pages_per_sequence + j * n

        @pl.when(count == n)
        def _full():
            for i in range(n):
                self._page(h, self.pages_ref[base + i], slot, i)

        @pl.when(count < n)
        def _short():
            def one(i, carry):
                self._page(h, self.pages_ref[base + i], slot, i)
                return carry

            lax.fori_loop(0, count, one, 0)

    def wait(self, slot, count):
        """Waits for a block of ``count`` pages in ``slot``: a full block with one descriptor of
        the whole slot (the semaphore counts bytes), a short one page by page."""

        @pl.when(count == self.plan.pages_per_block)
        def _full():
            for a, buf in enumerate(self.bufs):
                pltpu.make_async_copy(buf.at[slot], buf.at[slot], self.sems.at[a, slot]).wait()

        @pl.when(count < self.plan.pages_per_block)
        def _short():
            def one(i, carry):
                for a, buf in enumerate(self.bufs):
                    pltpu.make_async_copy(buf.at[slot, 0], buf.at[slot, 0], self.sems.at[a, slot]).wait()
                return carry

            lax.fori_loop(0, count, one, 0)


def _load(plan: Plan, buf, scale_buf, slot):
    """A block of keys or values as ``[block_tokens, head_dim]`` in the compute dtype."""
    x = buf[slot]
    if scale_buf is not None:
        x = x.astype(_F32) * (scale_buf[slot].astype(_F32) * _INV_MAX_INT8)
    elif plan.page_size % (8 * 4 // x.dtype.itemsize):  # pages off the dtype's sublane tile
        x = x.astype(_F32)
    return x.reshape(plan.block_tokens, plan.head_dim).astype(plan.compute_dtype)


def _attend(plan: Plan, q, bufs, slot, j, length, carry, masked):
    """One block of the online softmax: ``carry`` is ``(m, l, acc)`` of the ``groups`` rows."""
    m_prev, l_prev, acc = carry
    ks = bufs[2] if plan.quantized else None
    vs = bufs[3] if plan.quantized else None
    k = _load(plan, bufs[0], ks, slot)
    s = lax.dot_general(q, k, _TRANS_B, preferred_element_type=_F32)
    if plan.soft_cap is not None:
        s = jnp.tanh(s * (1.0 / plan.soft_cap)) * plan.soft_cap
    if masked:  # the last block: keys at or past the length (and stale slots) are masked
        pos = j * plan.block_tokens + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(pos < length, s, plan.mask_value)
    m = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m)
    p = jnp.exp(s - m)
    l = alpha * l_prev + p.sum(axis=1, keepdims=True)
    v = _load(plan, bufs[1], vs, slot)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    return m, l, alpha * acc + pv


def _kernel(plan: Plan, lengths_ref, pages_ref, q_ref, *refs):
    arrays = 4 if plan.quantized else 2
    hbm, o_ref = refs[:arrays], refs[arrays]
    bufs, (sems, state) = refs[arrays + 1 : 2 * arrays + 1], refs[2 * arrays + 1 :]
    c, bi, hi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, h = plan.seq_head(c, bi, hi)
    copies = _Copies(plan, pages_ref, hbm, bufs, sems)
    most = plan.pages_per_sequence * plan.page_size

    @pl.when((bi == 0) & (hi == 0))
    def _first_step_of_core():
        # A short block leaves slots stale; zeros (then real pages) keep NaN out of p @ v.
        for buf in bufs:
            buf[...] = jnp.zeros(buf.shape, buf.dtype)
        state[0] = 0  # the slot the step's first block goes to
        state[1] = 0  # whether the previous step started it

    length = jnp.minimum(lengths_ref[b], most)
    # The next step on this core, whose first block the last block of this one starts.
    last_h = hi == plan.steps_h - 1
    next_bi = jnp.where(last_h, bi + 1, bi)
    nb, nh = plan.seq_head(c, jnp.minimum(next_bi, plan.steps_b - 1), jnp.where(last_h, 0, hi + 1))
    next_length = jnp.where(next_bi < plan.steps_b, jnp.minimum(lengths_ref[nb], most), 0)

    @pl.when(length <= 0)
    def _empty():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(length > 0)
    def _attention():
        slot0 = state[0]

        @pl.when(state[1] == 0)
        def _():
            copies.start(b, h, 0, slot0, length)

        state[1] = 0
        blocks = pl.cdiv(length, plan.block_tokens)
        q = q_ref[...].astype(plan.compute_dtype)

        def full_block(j, st):
            slot, carry = st[0], st[1:]
            copies.start(b, h, j + 1, 1 - slot, length)
            copies.wait(slot, plan.pages_per_block)
            return (1 - slot, *_attend(plan, q, bufs, slot, j, length, carry, masked=False))

        rows = (plan.groups, 1)
        init = (
            jnp.full(rows, -jnp.inf, _F32),
            jnp.zeros(rows, _F32),
            jnp.zeros((plan.groups, plan.head_dim), _F32),
        )
        slot, *carry = lax.fori_loop(0, blocks - 1, full_block, (slot0, *init))
        last = blocks - 1

        @pl.when(next_length > 0)
        def _prefetch_next_step():
            copies.start(nb, nh, 0, 1 - slot, next_length)
            state[1] = 1

        copies.wait(slot, plan.block_pages(last, length))
        _, l, acc = _attend(plan, q, bufs, slot, last, length, carry, masked=True)
        state[0] = 1 - slot
        o_ref[...] = (acc / l).astype(o_ref.dtype)


def call(plan: Plan, q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, interpret):
    """The ``pallas_call`` of ``plan`` on its arguments; ``q``'s shape back."""
    batch, num_q_heads, head_dim = q.shape
    q4 = q.reshape(batch, plan.num_kv_heads, plan.groups, head_dim)

    def rows(c, bi, hi, *_):
        b, h = plan.seq_head(c, bi, hi)
        return b, h, 0, 0

    spec = pl.BlockSpec((None, None, plan.groups, head_dim), rows)
    arrays = [k_pages, v_pages] + ([k_scales, v_scales] if plan.quantized else [])
    n = plan.pages_per_block
    scratch = [pltpu.VMEM((2, n, plan.page_size, a.shape[-1]), a.dtype) for a in arrays]
    scratch += [pltpu.SemaphoreType.DMA((len(arrays), 2)), pltpu.SMEM((2,), jnp.int32)]
    buffers = sum(2 * n * _padded(plan.page_size, a.shape[-1], a.dtype) for a in arrays)
    info = pltpu.get_tpu_info()
    need = buffers + 4 * _padded(plan.groups, head_dim, q.dtype) + 6 * plan.groups * plan.block_tokens * 4
    keys = batch * plan.num_kv_heads * plan.pages_per_sequence * plan.page_size
    cost = pl.CostEstimate(
        flops=4 * keys * plan.groups * head_dim,
        transcendentals=keys * plan.groups,
        bytes_accessed=sum(keys * a.shape[-1] * a.dtype.itemsize for a in arrays)
        + 2 * q.size * q.dtype.itemsize,
    )
    out = pl.pallas_call(
        lambda *refs: _kernel(plan, *refs),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(plan.cores, plan.steps_b, plan.steps_h),
            in_specs=[spec] + [pl.BlockSpec(memory_space=pl.ANY)] * len(arrays),
            out_specs=spec,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=int(min(info.vmem_capacity_bytes * 0.9, max(32 << 20, 2 * need + (8 << 20)))),
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="paged_attention",
    )(lengths, page_indices.reshape(-1), q4, *arrays)
    return out.reshape(batch, num_q_heads, head_dim)


def _padded(rows, cols, dtype) -> int:
    """Bytes of a ``[rows, cols]`` VMEM tile row-block, padded to (sublane tile, 128 lanes)."""
    itemsize = np.dtype(dtype).itemsize
    sub = 8 * 4 // itemsize
    return -(-rows // sub) * sub * -(-cols // 128) * 128 * itemsize
