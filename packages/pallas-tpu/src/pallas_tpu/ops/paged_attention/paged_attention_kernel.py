"""Paged attention for decoding on TPUs, written with pallas-tpu, with the name and call
signature of JAX's ``ops.tpu.paged_attention.paged_attention``.

One query token per sequence attends to that sequence's keys and values, kept in pages of a
shared cache (``k_pages``/``v_pages``: ``[num_kv_heads, total_num_pages, page_size, head_dim]``)
that ``page_indices`` names per sequence. Grouped-query attention: the ``num_q_heads //
num_kv_heads`` query heads of a KV head are the rows of one score tile. The op is bound by the
cache's reads, so the kernel is a DMA schedule with arithmetic beside it:

* The page table and lengths are scalar-prefetched (SMEM). The pages stay in HBM
  (``memory_space=ANY``); a grid step, one (sequence, KV head), walks the sequence in compute
  blocks of ``pages_per_compute_block`` pages, each page one DMA per array into a VMEM slot.
  The blocks a core walks form one stream across its grid steps, kept ``AHEAD = 2`` blocks
  ahead in four slots: while block ``j`` is computed, block ``j + 1`` is in flight and block
  ``j + 2``'s copies are issued; the last blocks of a step start the first blocks of the next
  step (the same core's next (sequence, head) with keys), so the DMA queue never drains between
  steps. A full block is waited for with one descriptor of the whole slot (a DMA semaphore
  counts bytes); only a sequence's last, short block copies fewer pages (a loop) and waits page
  by page.
* The cost at small pages is the copies' issue, not their bytes: each page is a K and a V copy,
  and each copy costs scalar work (the page index load, address arithmetic). Measured on
  libtpu's v5e schedule (``--xla_jf_dump_to``, B32, 32/8 heads, D128, bf16, 2048 keys a block),
  a block of 128 pages of 16 keys first took ~4,300 bundles: ~15 a copy, half of them Mosaic's
  run-time bounds checks on the copy's source and destination, and the copies issued apart from
  the arithmetic. Hence: the page table is clamped into the cache (``jnp.clip`` before the
  call), so no copy can leave the arrays, and the bounds checks are off
  (``disable_bounds_checks``); the slots are split over two VMEM allocations so that block
  ``j + 2``'s copies and block ``j``'s loads are provably apart (in one allocation with a
  dynamic slot the scheduler serializes them). With the copies as straight-line code beside the
  block's matmuls and softmax, a block of 128 pages of 16 took ~1,190 bundles (~4.6 a copy: the
  2 scalar slots' address arithmetic), 32 pages of 64 ~530, against the ~1,300 ns that 1 MiB
  takes at the v5e's HBM bandwidth. They are now a loop of 8 pages an iteration (``_kernel.UNROLL``),
  so the kernel's code does not grow with the block (straight-line, a block of 64 pages made
  it 26k Mosaic ops, its first call 3x JAX's op's): ~9 bundles a page issued before the
  arithmetic, ~1,000 bundles a block of 64 pages of 32 (~850 straight-line), ~1,580 at 128
  pages of 16.
* The online softmax (running max ``m``, sum ``l`` and unnormalized output) lives in registers
  across a step's blocks; only the last ``AHEAD`` blocks of a sequence (the "tail", where the
  block ``AHEAD`` on is short or in the next step) are masked, by a select against the length
  (so a stale row never reaches the sum: the value buffers are zeroed once, and a masked
  probability is exactly 0).
* A page index outside ``[0, total_num_pages)`` among a sequence's pages in use makes that
  sequence's output NaN (JAX's op stops at a failed bounds check on a TPU); the copies read a
  clamped table, so none leaves the cache. Entries past a sequence's length are never read
  and may hold anything.
* Quantized pages (``QuantizedTensor``: int8 codes, one scale per key or per element) are
  copied as they are (a quarter of bf16's bytes per element beside the scales) and widened in
  VMEM: ``code * scale / 127.5``.

``megacore_mode`` splits the batch or the KV heads over a leading ``"parallel"`` grid axis (two
TensorCores of a megacore chip); each core's steps chain their own prefetches, so the kernel is
correct on one core too. ``inline_seq_dim`` is accepted for JAX's signature: the blocks of a
sequence are always walked inside its grid step. ``pages_per_compute_block`` may be left out:
``choose_pages_per_compute_block`` picks it (no measured table yet: a rule from the bytes a block
must keep in flight to cover HBM latency on the chip).

The modules (the skeleton of every family, ``pallas_tpu.ops``' docstring): this one (the API,
with JAX's names), ``quantization_utils`` and ``util`` (the reference), with JAX's names;
``_kernel`` the kernel body and its ``pallas_call``; ``_blocks`` the block choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops.paged_attention import quantization_utils
from pallas_tpu.ops.paged_attention._blocks import (
    choose_pages_per_compute_block as choose_pages_per_compute_block,
)
from pallas_tpu.ops.paged_attention._kernel import Plan as _Plan
from pallas_tpu.ops.paged_attention._kernel import call as _call

#: The logit of keys past a sequence's length (JAX's value).
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
#: What ``megacore_mode`` may be: the KV heads or the batch split over two TensorCores, or None.
MEGACORE_MODES = ("kv_head", "batch", None)


def _split(value, op, name) -> tuple[jax.Array, jax.Array | None]:
    """``(pages, scales)`` of a KV argument: an array, or a ``QuantizedTensor``."""
    if isinstance(value, quantization_utils.QuantizedTensor):
        pages, scales = jnp.asarray(value.weight), jnp.asarray(value.scales)
        if pages.dtype != jnp.int8:
            raise TypeError(f"{op}: {name}.weight must be int8 codes, got {pages.dtype}")
        if (
            scales.ndim != 4
            or scales.shape[:3] != pages.shape[:3]
            or scales.shape[3] not in (1, pages.shape[3])
        ):
            raise ValueError(
                f"{op}: {name}.scales must have shape {pages.shape[:3] + (1,)} (one scale per key) "
                f"or {pages.shape} (one per element), got {scales.shape}"
            )
        return pages, scales
    return jnp.asarray(value), None


def _require(ok: bool, error: type[Exception], message: str) -> None:
    if not ok:
        raise error(f"paged_attention: {message}")


def _check(q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, ppcb, megacore_mode, cap):
    _require(q.ndim == 3, ValueError, f"q must be [batch_size, num_q_heads, head_dim], got shape {q.shape}")
    _require(k_pages.ndim == 4, ValueError, "k_pages must be [num_kv_heads, total_num_pages, page_size, "
             f"head_dim], got shape {k_pages.shape}")  # fmt: skip
    _require(k_pages.shape == v_pages.shape, ValueError,
             f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")  # fmt: skip
    _require((k_scales is None) == (v_scales is None), TypeError,
             "k_pages and v_pages must both be QuantizedTensor or both arrays")  # fmt: skip
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, head_dim_k = k_pages.shape
    _require(num_q_heads % num_kv_heads == 0, ValueError,
             f"the number of q heads ({num_q_heads}) must be a multiple of the KV heads ({num_kv_heads})")  # fmt: skip
    _require(
        head_dim_k == head_dim, ValueError, f"q's head_dim {head_dim} differs from k_pages' {head_dim_k}"
    )
    _require(jnp.issubdtype(q.dtype, jnp.floating), TypeError, f"q must be a float array, got {q.dtype}")
    floats = k_pages.dtype == v_pages.dtype and jnp.issubdtype(k_pages.dtype, jnp.floating)
    _require(k_scales is not None or floats, TypeError,
             f"k_pages and v_pages must be float arrays of one dtype, got {k_pages.dtype}, {v_pages.dtype}")  # fmt: skip
    _require(lengths.shape == (batch,) and lengths.dtype == jnp.int32, ValueError,
             f"lengths must be int32[{batch}] (one per sequence of q), got {lengths.dtype}{list(lengths.shape)}")  # fmt: skip
    table_ok = page_indices.ndim == 2 and page_indices.shape[0] == batch and page_indices.dtype == jnp.int32
    _require(table_ok, ValueError, f"page_indices must be int32[{batch}, pages_per_sequence], got "
             f"{page_indices.dtype}{list(page_indices.shape)}")  # fmt: skip
    _check_options(batch, num_kv_heads, page_indices.shape[1], ppcb, megacore_mode, cap)


def _check_options(batch, num_kv_heads, pages_per_sequence, ppcb, megacore_mode, cap):
    ppcb_ok = ppcb is None or (isinstance(ppcb, (int, np.integer)) and 0 < ppcb <= pages_per_sequence)
    _require(ppcb_ok, ValueError, f"pages_per_compute_block must be an int in [1, {pages_per_sequence}] "
             f"(pages per sequence), got {ppcb!r}")  # fmt: skip
    _require(megacore_mode in MEGACORE_MODES, ValueError,
             f"megacore_mode must be one of {list(MEGACORE_MODES)}, got {megacore_mode!r}")  # fmt: skip
    _require(megacore_mode != "kv_head" or num_kv_heads % 2 == 0, ValueError,
             f"megacore_mode='kv_head' needs an even number of KV heads, got {num_kv_heads}")  # fmt: skip
    _require(megacore_mode != "batch" or batch % 2 == 0, ValueError,
             f"megacore_mode='batch' needs an even batch size, got {batch}")  # fmt: skip
    _require(
        cap is None or cap != 0, ValueError, "attn_logits_soft_cap must not be 0 (None turns the cap off)"
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array | quantization_utils.QuantizedTensor,
    v_pages: jax.Array | quantization_utils.QuantizedTensor,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    mask_value: float = DEFAULT_MASK_VALUE,
    attn_logits_soft_cap: float | None = None,
    pages_per_compute_block: int | None = None,
    megacore_mode: str | None = None,
    inline_seq_dim: bool = True,
    interpret=False,
) -> jax.Array:
    _check_concrete_lengths(lengths, page_indices, k_pages)
    return _paged_attention(
        q, k_pages, v_pages, lengths, page_indices, mask_value=mask_value,
        attn_logits_soft_cap=attn_logits_soft_cap, pages_per_compute_block=pages_per_compute_block,
        megacore_mode=megacore_mode, inline_seq_dim=inline_seq_dim, interpret=interpret,
    )  # fmt: skip


def _check_concrete_lengths(lengths, page_indices, k_pages):
    """Refuses known (not traced) lengths outside ``[0, pages_per_sequence * page_size]``."""
    if any(isinstance(x, jax.core.Tracer) for x in (lengths, page_indices)):
        return
    pages = k_pages.weight if isinstance(k_pages, quantization_utils.QuantizedTensor) else k_pages
    if np.ndim(lengths) != 1 or np.ndim(page_indices) != 2 or np.ndim(pages) != 4:
        return  # the shape checks explain it
    indices = np.asarray(page_indices)
    if np.issubdtype(indices.dtype, np.floating) and not np.array_equal(indices, np.round(indices)):
        raise ValueError(
            f"paged_attention: page_indices must be int32 (or floats holding integers), got {indices.dtype} "
            f"with a fraction"
        )
    most = np.shape(page_indices)[1] * np.shape(pages)[2]
    values = np.asarray(lengths)
    bad = (values < 0) | (values > most)
    if values.size and bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"paged_attention: lengths[{i}]={int(values[i])} is outside [0, {most}]: a sequence holds at "
            f"most pages_per_sequence * page_size = {np.shape(page_indices)[1]} * {np.shape(pages)[2]} keys"
        )


_STATIC = ("pages_per_compute_block", "attn_logits_soft_cap", "mask_value", "megacore_mode", "inline_seq_dim")


@functools.partial(jax.jit, static_argnames=[*_STATIC, "interpret"])
def _paged_attention(
    q, k_pages, v_pages, lengths, page_indices, *, mask_value, attn_logits_soft_cap, pages_per_compute_block,
    megacore_mode, inline_seq_dim, interpret,
):  # fmt: skip
    """Paged grouped-query attention of one query token per sequence.

    Args:
      q: ``[batch_size, num_q_heads, head_dim]`` (already scaled: no softmax scale is applied).
      k_pages: ``[num_kv_heads, total_num_pages, page_size, head_dim]``, or a
        ``quantization_utils.QuantizedTensor`` of int8 codes and their scales.
      v_pages: as ``k_pages``.
      lengths: ``int32[batch_size]``: how many keys each sequence has (0: its output is 0),
        at most ``pages_per_sequence * page_size``: known (not traced) lengths outside
        ``[0, pages_per_sequence * page_size]`` raise ``ValueError``; traced ones are
        clamped into that range.
      page_indices: ``int32[batch_size, pages_per_sequence]``: the pages of each sequence, in
        ``[0, total_num_pages)``; entries past a sequence's length are not read. Float
        indices holding integers are taken as JAX's op takes them (converted to int32).
      mask_value: the logit given to keys past a sequence's length.
      attn_logits_soft_cap: when set, logits become ``tanh(logits / cap) * cap``.
      pages_per_compute_block: pages per compute block (None: chosen by
        ``choose_pages_per_compute_block``); need not divide ``pages_per_sequence``.
      megacore_mode: ``"kv_head"``, ``"batch"`` (split over two TensorCores) or None.
      inline_seq_dim: accepted for JAX's signature (the kernel always walks a sequence inside
        one grid step).
      interpret: run in TPU interpret mode (``True`` or ``pltpu.InterpretParams``).

    Returns:
      ``[batch_size, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    if not isinstance(inline_seq_dim, bool):
        raise TypeError(f"paged_attention: inline_seq_dim must be a bool, got {inline_seq_dim!r}")
    k_pages, k_scales = _split(k_pages, "paged_attention", "k_pages")
    v_pages, v_scales = _split(v_pages, "paged_attention", "v_pages")
    q, lengths, page_indices = jnp.asarray(q), jnp.asarray(lengths), jnp.asarray(page_indices)
    if jnp.issubdtype(page_indices.dtype, jnp.floating):
        page_indices = page_indices.astype(jnp.int32)
    cap, ppcb = attn_logits_soft_cap, pages_per_compute_block
    _check(q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, ppcb, megacore_mode, cap)
    plan = _plan(q, k_pages, k_scales, page_indices.shape[1], ppcb, megacore_mode, mask_value, cap)
    return _call(plan, q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, interpret)


def _plan(q, k_pages, k_scales, pages_per_sequence, ppcb, megacore_mode, mask_value, cap) -> _Plan:
    """The static facts of a call whose arguments ``_check`` passed."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    scales_dim = None if k_scales is None else k_scales.shape[-1]
    itemsize = k_pages.dtype.itemsize
    pages_per_block = ppcb or choose_pages_per_compute_block(
        page_size, head_dim, pages_per_sequence, itemsize, pltpu.get_tpu_info(), scales_dim=scales_dim
    )
    return _Plan(
        batch=batch, num_kv_heads=num_kv_heads, groups=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_sequence=pages_per_sequence, pages_per_block=int(pages_per_block),
        cores=1 if megacore_mode is None else 2, split=megacore_mode, quantized=k_scales is not None,
        mask_value=float(mask_value), soft_cap=None if cap is None else float(cap),
        # int8 pages widen to float32 (code * scale): kept there, as JAX's op does.
        compute_dtype=jnp.dtype(jnp.float32) if k_scales is not None else jnp.promote_types(q.dtype, k_pages.dtype),
    )  # fmt: skip


paged_attention.__doc__ = _paged_attention.__doc__


class MultiPageAsyncCopyDescriptor:
    """The copies of ``num_pages_to_load`` pages (and their scales) from HBM into a VMEM
    buffer, with the constructor of JAX's class of this name: page ``i`` is
    ``page_indices[page_indices_start_offset + i]`` of ``pages_hbm_ref`` (of its head
    ``head_index`` when not None), all copies signalling ``sem``. For kernels written against
    JAX's module; ``paged_attention``'s own kernel schedules its copies itself."""

    def __init__(
        self,
        pages_hbm_ref,
        scales_pages_hbm_ref,
        vmem_buffer,
        scales_vmem_buffer,
        sem,
        page_indices,
        page_indices_start_offset,
        num_pages_to_load,
        head_index,
    ):
        if head_index is not None:
            pages_hbm_ref = pages_hbm_ref.at[head_index]
            if scales_pages_hbm_ref is not None:
                scales_pages_hbm_ref = scales_pages_hbm_ref.at[head_index]
        self._buffer, self._scales_buffer = vmem_buffer, scales_vmem_buffer
        pairs = [(pages_hbm_ref, vmem_buffer)]
        if scales_pages_hbm_ref is not None and scales_vmem_buffer is not None:
            pairs.append((scales_pages_hbm_ref, scales_vmem_buffer))
        self._copies = [
            pltpu.make_async_copy(src.at[page_indices[page_indices_start_offset + i]], dst.at[i], sem)
            for src, dst in pairs
            for i in range(num_pages_to_load)
        ]

    def start(self):
        """Starts every copy."""
        for copy in self._copies:
            copy.start()

    def wait_and_get_loaded(self) -> jax.Array:
        """Waits for every copy; the pages as float32 ``[pages * page_size, head_dim]``
        (int8 codes widened with their scales: ``code * scale / 127.5``)."""
        for copy in self._copies:
            copy.wait()
        x = self._buffer[...].astype(jnp.float32)
        if self._scales_buffer is not None:
            x = x * (self._scales_buffer[...].astype(jnp.float32) / quantization_utils.MAX_INT8)
        return x.reshape(-1, x.shape[-1])


def _not_this_kernel(name):
    raise NotImplementedError(
        f"{name}: JAX's kernel body of this name (its grid, scratch and semaphore layout) is not "
        f"provided; call paged_attention(...), whose kernel schedules the page copies across grid "
        f"steps (see this module's docstring), or MultiPageAsyncCopyDescriptor in a kernel of your own"
    )


def paged_flash_attention_kernel(
    lengths_ref, page_indices_ref, buffer_index_ref, init_flag_ref, q_ref, k_pages_hbm_ref,
    k_scales_pages_hbm_ref, v_pages_hbm_ref, v_scales_pages_hbm_ref, o_ref, m_ref, l_ref, k_vmem_buffer,
    k_scales_vmem_buffer, v_vmem_buffer, v_scales_vmem_buffer, k_sems, v_sems, *, batch_size: int,
    pages_per_compute_block: int, pages_per_sequence: int, mask_value: float,
    attn_logits_soft_cap: float | None, megacore_mode: str | None, program_ids=(), length=None,
):  # fmt: skip
    """JAX's kernel name and signature (``length`` as JAX 0.12 adds it); raises
    ``NotImplementedError`` (use ``paged_attention``)."""
    _not_this_kernel("paged_flash_attention_kernel")


def paged_flash_attention_kernel_inline_seq_dim(
    lengths_ref, page_indices_ref, buffer_index_ref, init_flag_ref, q_ref, k_pages_hbm_ref,
    k_scales_pages_hbm_ref, v_pages_hbm_ref, v_scales_pages_hbm_ref, o_ref, m_ref, l_ref, k_vmem_buffer,
    k_scales_vmem_buffer, v_vmem_buffer, v_scales_vmem_buffer, k_sems, v_sems, *, batch_size: int,
    pages_per_compute_block: int, pages_per_sequence: int, mask_value: float,
    attn_logits_soft_cap: float | None, megacore_mode: str | None,
):  # fmt: skip
    """JAX's kernel name and signature; raises ``NotImplementedError`` (use ``paged_attention``)."""
    _not_this_kernel("paged_flash_attention_kernel_inline_seq_dim")
