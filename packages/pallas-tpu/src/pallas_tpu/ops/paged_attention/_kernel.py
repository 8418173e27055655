"""The kernel behind ``paged_attention``: the DMA schedule of the pages and the online softmax
(``paged_attention_kernel``'s docstring says how it works), and its ``pallas_call``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy

_F32 = jnp.float32
_TRANS_B = (((1,), (1,)), ((), ()))
_INV_MAX_INT8 = 1.0 / 127.5
# The blocks a core walks form one stream across its grid steps; block p of it goes to slot
# p % SLOTS. A block is computed while the next AHEAD are in flight (the last of them being
# issued beside the computation). Slots are split over two VMEM allocations ("halves", slot
# p in half (p // 2) % 2, row p % 2 of it): block p and block p + AHEAD are always in different
# halves, so the scheduler can tell the copies being issued from the loads being computed (one
# allocation with a dynamic slot index serializes them).
SLOTS = 4
AHEAD = 2
# Pages a full block's copy loop starts an iteration. The copies of a loop are issued apart
# from the block's arithmetic (libtpu's v5e schedule, 32/8 heads, D128, bf16, 2048 keys a
# block: ~9 bundles a page against ~7 in straight-line code beside the matmuls), but the code
# stays the same size at any block: unrolled, a block of 64 pages made the kernel 26k Mosaic ops
# and its first call 3x JAX's op's. 8 holds the loop's own overhead to ~1 bundle a page.
UNROLL = 8


def _half(p):
    return (p // 2) % 2


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
    """The DMAs of a (sequence, KV head)'s pages into the block buffers: every array (K, V, and
    their scales when quantized) moves the same pages, each slot on its own semaphore. Slot
    ``p`` (a stream position, taken mod ``SLOTS``) is row ``p % 2`` of half ``_half(p)``. The page
    table was clamped into the cache by the caller, so every copy is in bounds."""

    def __init__(self, plan: Plan, pages_ref, hbm, halves, sems):
        self.plan, self.pages_ref, self.hbm, self.halves, self.sems = plan, pages_ref, hbm, halves, sems

    def _slot(self, h, half, p):
        """``(source, destination, semaphore)`` per array for head ``h``'s pages into slot ``p``
        of ``half``: the page loops index them by page only (``p >= 0``: masks, not ``%``)."""
        row, sem = p & 1, p & (SLOTS - 1)
        return [
            (src.at[h], buf.at[row], self.sems.at[a, sem])
            for a, (src, buf) in enumerate(zip(self.hbm, self.halves[half]))
        ]

    def _base(self, b, j):
        return b * self.plan.pages_per_sequence + j * self.plan.pages_per_block

    def _loop(self, b, h, j, half, p, count, unroll=1):
        base = self._base(b, j)
        slot = self._slot(h, half, p)

        def one(i, carry):
            page = self.pages_ref[base + i]
            for src, dst, sem in slot:
                pltpu.make_async_copy(src.at[page], dst.at[i], sem).start()
            return carry

        lax.fori_loop(0, count, one, 0, unroll=unroll)

    def start_full(self, b, h, j, half, p):
        """Starts full block ``j`` of sequence ``b`` into slot ``p`` (of the static ``half``): a
        loop of ``UNROLL`` pages an iteration, so the kernel's code does not grow with the block."""
        self._loop(b, h, j, half, p, self.plan.pages_per_block, min(UNROLL, self.plan.pages_per_block))

    def start_pages(self, b, h, j, p, count, half=None):
        """Starts the first ``count`` pages of block ``j`` of sequence ``b`` into slot ``p`` with
        a loop (a short block, or a rare one), in ``half`` or, when None, the slot's half."""
        for x in range(2) if half is None else (half,):

            @pl.when((_half(p) == x) if half is None else True)
            def _(x=x):
                self._loop(b, h, j, x, p, count)

    def wait(self, half, p, count):
        """Waits for a block of ``count`` pages in slot ``p`` (of the static ``half``): a full one
        with one descriptor of the whole slot per array (a DMA semaphore counts bytes: the
        block's pages signalled it), a short one page by page."""

        def one(i, carry, whole=False):
            for a, buf in enumerate(self.halves[half]):
                dst = buf.at[p % 2] if whole else buf.at[p % 2, 0]
                pltpu.make_async_copy(dst, dst, self.sems.at[a, p % SLOTS]).wait()
            return carry

        if count is None:  # known to be full
            one(0, 0, whole=True)
            return

        @pl.when(count == self.plan.pages_per_block)
        def _full():
            one(0, 0, whole=True)

        @pl.when(count < self.plan.pages_per_block)
        def _short():
            lax.fori_loop(0, count, one, 0)


def _load(plan: Plan, buf, scale_buf, row):
    """A block of keys or values as ``[block_tokens, head_dim]`` in the compute dtype."""
    x = buf[row]
    if scale_buf is not None:
        x = x.astype(_F32) * (scale_buf[row].astype(_F32) * _INV_MAX_INT8)
    elif plan.page_size % (8 * 4 // x.dtype.itemsize):  # pages off the dtype's sublane tile
        x = x.astype(_F32)
    return x.reshape(plan.block_tokens, plan.head_dim).astype(plan.compute_dtype)


def _attend(plan: Plan, q, bufs, row, j, length, carry, masked):
    """One block (``row`` of the half ``bufs``) of the online softmax: ``carry`` is
    ``(m, l, acc)`` of the ``groups`` rows."""
    m_prev, l_prev, acc = carry
    ks = bufs[2] if plan.quantized else None
    vs = bufs[3] if plan.quantized else None
    k = _load(plan, bufs[0], ks, row)
    s = lax.dot_general(q, k, _TRANS_B, preferred_element_type=_F32)
    if plan.soft_cap is not None:
        s = jnp.tanh(s * (1.0 / plan.soft_cap)) * plan.soft_cap
    if masked:  # keys at or past the length (and stale slots of a short block) are masked
        pos = j * plan.block_tokens + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(pos < length, s, plan.mask_value)
    m = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m)
    p = jnp.exp(s - m)
    l = alpha * l_prev + p.sum(axis=1, keepdims=True)
    v = _load(plan, bufs[1], vs, row)
    return m, l, alpha * acc + weighted_values(p, v)


def weighted_values(p, v):
    """``p @ v`` for float32 probabilities ``p``, accumulated in float32, as JAX's kernels take it:
    float32 operands at the default precision. On a TPU's MXU that is one bf16 pass (what an
    explicit rounding of ``p`` costs, and no more); in interpret mode it is exact. Splitting ``p``
    into two 16-bit parts would be more accurate than JAX's op at twice the MXU passes."""
    dims = (((1,), (0,)), ((), ()))
    return lax.dot_general(p, v.astype(_F32), dims, preferred_element_type=_F32)


class _Step:
    """A grid step's place in its core's stream of blocks: its (sequence, KV head) and the next
    step's, whose first blocks this step's last ones start."""

    def __init__(self, plan: Plan, copies: _Copies, c, bi, hi):
        self.plan, self.copies = plan, copies
        self.b, self.h = plan.seq_head(c, bi, hi)
        self.most = plan.pages_per_sequence * plan.page_size

    def locate(self, lengths_ref, state, c, bi, hi):
        """This step's length and blocks, and the next step's on this core (the stream runs on
        into its first blocks)."""
        plan, bt = self.plan, self.plan.block_tokens
        self.length = jnp.clip(lengths_ref[self.b], 0, self.most)
        self.blocks = pl.cdiv(self.length, bt)
        last_h = hi == plan.steps_h - 1
        next_bi = jnp.where(last_h, bi + 1, bi)
        self.nb, self.nh = plan.seq_head(
            c, jnp.minimum(next_bi, plan.steps_b - 1), jnp.where(last_h, 0, hi + 1)
        )
        self.next_length = jnp.where(next_bi < plan.steps_b, jnp.clip(lengths_ref[self.nb], 0, self.most), 0)
        self.next_blocks = pl.cdiv(self.next_length, bt)
        self.pos0 = state[0]

    def target(self, j):
        """Block ``j`` blocks after this step's first in the stream: ``(sequence, head, block,
        pages)``, one of this sequence's or of the next step's (0 pages past those)."""
        here = j < self.blocks
        tj, tlen = jnp.where(here, j, j - self.blocks), jnp.where(here, self.length, self.next_length)
        count = jnp.maximum(self.plan.block_pages(tj, tlen), 0)
        return jnp.where(here, self.b, self.nb), jnp.where(here, self.h, self.nh), tj, count

    def prologue(self, j, carry):
        """Starts block ``j``, which the step before did not (it starts ``AHEAD`` blocks at most):
        only after an empty step and on a core's first step, so a plain loop."""
        tb, th, tj, count = self.target(j)
        self.copies.start_pages(tb, th, tj, (self.pos0 + j) % SLOTS, count)
        return carry

    def steady(self, q, halves, j, carry):
        """Block ``j`` when blocks ``j .. j + AHEAD`` are full blocks of this sequence: no branch
        between the copies of block ``j + AHEAD`` (the other half) and block ``j``'s arithmetic,
        which interleave."""
        p = (self.pos0 + j) % SLOTS

        def on(half):
            def body(carry):
                self.copies.wait(half, p, None)
                self.copies.start_full(self.b, self.h, j + AHEAD, 1 - half, p + AHEAD)
                return _attend(self.plan, q, halves[half], p % 2, j, self.length, carry, masked=False)

            return body

        return lax.cond(_half(p) == 0, on(0), on(1), carry)

    def tail(self, q, halves, j, carry):
        """One of the last blocks: a short one, or one whose block ``AHEAD`` on is in the next
        step (or none)."""
        plan, p = self.plan, (self.pos0 + j) % SLOTS

        def on(half):
            def body(carry):
                self.copies.wait(half, p, plan.block_pages(j, self.length))
                tb, th, tj, count = self.target(j + AHEAD)

                def full(carry):  # as in the steady loop: copies beside the arithmetic
                    self.copies.start_full(tb, th, tj, 1 - half, p + AHEAD)
                    return _attend(plan, q, halves[half], p % 2, j, self.length, carry, masked=True)

                def partial(carry):
                    self.copies.start_pages(tb, th, tj, p + AHEAD, count, 1 - half)
                    return _attend(plan, q, halves[half], p % 2, j, self.length, carry, masked=True)

                return lax.cond(count == plan.pages_per_block, full, partial, carry)

            return body

        return lax.cond(_half(p) == 0, on(0), on(1), carry)


def _first_step_of_core(halves, state):
    # A short block leaves rows of a slot stale. Their scores are masked (a select), but
    # p @ v needs finite values: zeros (then real pages) in the value buffers.
    for half in halves:
        for buf in half[1::2]:  # values (and their scales)
            buf[...] = jnp.zeros(buf.shape, buf.dtype)
    state[0] = 0  # the stream position (mod SLOTS) of the step's first block
    state[1] = 0  # how many of the step's blocks the steps before started


def _kernel(plan: Plan, lengths_ref, pages_ref, q_ref, *refs):
    arrays = 4 if plan.quantized else 2
    hbm, o_ref = refs[:arrays], refs[arrays]
    halves = (refs[arrays + 1 : 2 * arrays + 1], refs[2 * arrays + 1 : 3 * arrays + 1])
    sems, state = refs[3 * arrays + 1 :]
    c, bi, hi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    step = _Step(plan, _Copies(plan, pages_ref, hbm, halves, sems), c, bi, hi)
    pl.when((bi == 0) & (hi == 0))(lambda: _first_step_of_core(halves, state))
    step.locate(lengths_ref, state, c, bi, hi)
    lax.fori_loop(state[1], AHEAD, step.prologue, 0)

    q = q_ref[...].astype(plan.compute_dtype)
    rows = (plan.groups, 1)
    init = (
        jnp.full(rows, -jnp.inf, _F32),
        jnp.zeros(rows, _F32),
        jnp.zeros((plan.groups, plan.head_dim), _F32),
    )
    n_steady = jnp.maximum(step.length // plan.block_tokens - AHEAD, 0)
    carry = lax.fori_loop(0, n_steady, lambda j, carry: step.steady(q, halves, j, carry), init)
    _, l, acc = lax.fori_loop(n_steady, step.blocks, lambda j, carry: step.tail(q, halves, j, carry), carry)
    state[0] = (step.pos0 + step.blocks) % SLOTS
    state[1] = jnp.minimum(step.next_blocks, AHEAD)
    # An empty sequence (l == 0, acc == 0) gives zeros.
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


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
    scratch = [pltpu.VMEM((SLOTS // 2, n, plan.page_size, a.shape[-1]), a.dtype) for a in arrays] * 2
    scratch += [pltpu.SemaphoreType.DMA((len(arrays), SLOTS)), pltpu.SMEM((2,), jnp.int32)]
    buffers = sum(SLOTS * n * padded_bytes(plan.page_size, a.shape[-1], a.dtype) for a in arrays)
    need = (
        buffers + 4 * padded_bytes(plan.groups, head_dim, q.dtype) + 6 * plan.groups * plan.block_tokens * 4
    )
    keys = batch * plan.num_kv_heads * plan.pages_per_sequence * plan.page_size
    cost = pl.CostEstimate(
        flops=4 * keys * plan.groups * head_dim,
        transcendentals=keys * plan.groups,
        bytes_accessed=sum(keys * a.shape[-1] * a.dtype.itemsize for a in arrays)
        + 2 * q.size * q.dtype.itemsize,
    )
    # Every page index is clamped into the cache here (one small fusion), so no copy can leave
    # it, and Mosaic's run-time bounds checks (about 7 scalar bundles on each copy's source and
    # destination) are left out: with pages of 16 keys they cost more than the copies' bytes.
    pages = jnp.clip(page_indices.reshape(-1), 0, k_pages.shape[1] - 1)
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
            vmem_limit_bytes=_policy.vmem_limit("paged_attention", need),
            disable_bounds_checks=True,
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="paged_attention",
    )(lengths, pages, q4, *arrays)
    out = out.reshape(batch, num_q_heads, head_dim)
    # A page index outside the cache among a sequence's pages in use is the caller's error:
    # the clamp keeps the copies inside the cache, and that sequence's output is NaN, not
    # attention over another page (one small fusion over the page table).
    used = jnp.arange(page_indices.shape[1])[None, :] * plan.page_size < lengths[:, None]
    outside = (page_indices < 0) | (page_indices >= k_pages.shape[1])
    bad = jnp.any(used & outside, axis=1)
    return jnp.where(bad[:, None, None], jnp.asarray(jnp.nan, out.dtype), out)


def padded_bytes(rows, cols, dtype) -> int:
    """Bytes of a ``[rows, cols]`` VMEM tile row-block, padded to (sublane tile, 128 lanes)."""
    itemsize = np.dtype(dtype).itemsize
    sub = 8 * 4 // itemsize
    return -(-rows // sub) * sub * -(-cols // 128) * 128 * itemsize
