"""``flash_attention``: the entry point, its checks and its VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.ops import _policy

from ._backward import backward_dkv, backward_dq
from ._blocks import F32, BlockSizes, resolve_blocks
from ._forward import attention_forward


@functools.partial(jax.jit, static_argnames=["causal", "sm_scale", "block_sizes", "debug"])
def flash_attention(
    q,
    k,
    v,
    ab=None,
    segment_ids=None,
    *,
    causal: bool = False,
    sm_scale: float = 1.0,
    block_sizes: BlockSizes | None = None,
    debug: bool = False,
):
    """Multi-head attention ``softmax((q @ k.T + ab) * sm_scale, masked) @ v``, differentiable.

    Args:
      q: ``[batch, heads, q_seq_len, head_dim]`` queries.
      k: ``[batch, heads, kv_seq_len, head_dim]`` keys.
      v: ``[batch, heads, kv_seq_len, head_dim]`` values.
      ab: optional ``[batch, heads, q_seq_len, kv_seq_len]`` bias added to the logits before the
        scale (it gets a gradient).
      segment_ids: optional ``SegmentIds``: queries attend only to keys of the same segment.
      causal: query ``i`` attends only to keys ``j <= i`` (top-left aligned whatever the lengths,
        as JAX's op: with more keys than queries, the keys past the last query are seen by none).
      sm_scale: the scale of the logits.
      block_sizes: a ``BlockSizes``; None: ``tuned_block_sizes``'s (chosen from the shapes and
        the chip; ``BlockSizes.get_default`` returns JAX's default blocks instead).
      debug: print the kernels' jaxprs and Mosaic modules.

    Returns:
      ``[batch, heads, q_seq_len, head_dim]`` attention output in ``q``'s dtype. A query that
      sees no key (every key masked, or a bias row of about -1e30) gets, as in JAX's op, the
      mean of the values it was swept against, and contributes no gradient.
    """
    _check_types(q, k, v, ab, segment_ids, causal)
    _check_shapes(q, k, v, ab, segment_ids)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if 0 in (batch, heads, q_len, head_dim):
        return jnp.zeros(q.shape, q.dtype)  # nothing to attend from: the empty result
    if kv_len == 0:
        raise ValueError(
            f"flash_attention: kv_seq_len is 0 (k and v have shape {k.shape}) while q_seq_len is "
            f"{q_len}: each query needs at least one key to attend to"
        )
    blocks = resolve_blocks(block_sizes, batch, heads, q_len, kv_len, head_dim, causal)
    return _attention(q, k, v, ab, segment_ids, bool(causal), float(sm_scale), blocks, debug)


def _check_types(q, k, v, ab, segment_ids, causal):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"flash_attention: causal must be a bool, got {causal!r} ({type(causal).__name__})")
    for name, x in (("q", q), ("k", k), ("v", v), ("ab", ab)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"flash_attention: {name} must have a floating dtype (float32, bfloat16, ...), got {x.dtype}"
            )
    if segment_ids is not None:
        if not (hasattr(segment_ids, "q") and hasattr(segment_ids, "kv")):
            raise TypeError(
                "flash_attention: segment_ids must be a SegmentIds(q=..., kv=...) or None, "
                f"got {type(segment_ids).__name__}"
            )
        for name, x in (("q", segment_ids.q), ("kv", segment_ids.kv)):
            dtype = getattr(x, "dtype", None)
            ok = dtype is not None and any(
                jnp.issubdtype(dtype, kind) for kind in (jnp.integer, jnp.floating, jnp.bool_)
            )
            if not ok:
                raise TypeError(
                    f"flash_attention: segment_ids.{name} must be an integer (or float) array, got {dtype}"
                )


def _check_shapes(q, k, v, ab, segment_ids):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"flash_attention: {name} must be [batch, heads, seq, head_dim], got shape {x.shape}"
            )
    (b, h, lq, d), (bk, hk, lk, dk), (bv, hv, lv, dv) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(f"flash_attention: batch sizes of q, k, v differ: {b}, {bk}, {bv}")
    if not h == hk == hv:
        raise ValueError(f"flash_attention: head counts of q, k, v differ: {h}, {hk}, {hv}")
    if d != dk:
        raise ValueError(f"flash_attention: head_dim of q ({d}) and k ({dk}) differ")
    if d != dv:
        raise NotImplementedError(f"flash_attention: head_dim of v ({dv}) differs from q's and k's ({d})")
    if lk != lv:
        raise ValueError(f"flash_attention: kv_seq_len of k ({lk}) and v ({lv}) differ")
    if ab is not None and ab.shape != (b, h, lq, lk):
        raise ValueError(
            f"flash_attention: ab must have shape (batch, heads, q_seq_len, kv_seq_len) = {(b, h, lq, lk)}, "
            f"got {ab.shape}"
        )
    if segment_ids is not None:
        if segment_ids.q.shape != (b, lq):
            raise ValueError(
                f"flash_attention: segment_ids.q must have shape (batch, q_seq_len) = {(b, lq)}, "
                f"got {segment_ids.q.shape}"
            )
        if segment_ids.kv.shape != (b, lk):
            raise ValueError(
                f"flash_attention: segment_ids.kv must have shape (batch, kv_seq_len) = {(b, lk)}, "
                f"got {segment_ids.kv.shape}"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug):
    out, _ = attention_forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, keep_lse=False)
    return out


def _attention_fwd(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug):
    out, lse = attention_forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, keep_lse=True)
    return out, (q, k, v, ab, segment_ids, out, lse)


def _attention_bwd(causal, sm_scale, blocks, debug, residuals, d_out):
    q, k, v, ab, segment_ids, out, lse = residuals
    if _fused_backward_fits(q):
        dk, dv, dq, dab = backward_dkv(
            q, k, v, ab, segment_ids, lse, d_out, out, causal, sm_scale, blocks, debug, with_dq=True
        )
    else:
        # The separate kernels read di = rowsum(dO * O) = rowsum(dP * P), the softmax's
        # correction, as a lane-dense row per head.
        di = jnp.sum(out.astype(F32) * d_out.astype(F32), axis=-1)[:, :, None, :]
        dk, dv = backward_dkv(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug)
        dq, dab = backward_dq(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug)
    return dq, dk, dv, dab, None


def _fused_backward_fits(q) -> bool:
    """Whether a head's ``dq`` accumulator and queries take at most a quarter of the VMEM budget."""
    return q.shape[2] * q.shape[3] * (4 + q.dtype.itemsize) <= _policy.vmem_budget("attention") // 4


_attention.defvjp(_attention_fwd, _attention_bwd)
