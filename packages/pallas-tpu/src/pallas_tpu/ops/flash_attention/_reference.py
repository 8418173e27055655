"""Plain-JAX references with the names and signatures of JAX's module."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._blocks import DEFAULT_MASK_VALUE, F32, SegmentIds


def _reference_logits(q, k, ab, segment_ids, causal, mask_value, sm_scale):
    """Masked logits ``[b, h, q_len, kv_len]``: ``(q @ k.T + ab) * sm_scale``, ``mask_value`` added where masked."""
    logits = jnp.einsum("bhid,bhjd->bhij", q, k)
    if ab is not None:
        logits = logits + ab
    logits = logits * sm_scale if sm_scale != 1.0 else logits
    q_len, kv_len = q.shape[2], k.shape[2]
    visible = None
    if segment_ids is not None:
        visible = (segment_ids.q[:, :, None] == segment_ids.kv[:, None, :])[:, None]
    if causal:
        keys_before = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        visible = keys_before[None, None] if visible is None else visible & keys_before
    if visible is None:
        return logits
    return logits + jnp.where(visible, 0.0, mask_value)


def mha_reference_no_custom_vjp(
    q,
    k,
    v,
    ab=None,
    segment_ids=None,
    *,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale: float = 1.0,
    save_residuals: bool = False,
):
    """Attention in plain ``jnp`` (differentiated by JAX); with ``save_residuals`` also the
    softmax's row sums ``l`` and row maxima ``m``: ``(out, l, m)``."""
    logits = _reference_logits(q, k, ab, segment_ids, causal, mask_value, sm_scale)
    m = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - m[..., None])
    l = jnp.sum(e, axis=-1)
    out = jnp.einsum("bhij,bhjd->bhid", e / l[..., None], v)
    return (out, l, m) if save_residuals else out


@functools.partial(jax.jit, static_argnames=["causal", "mask_value", "sm_scale"])
@jax.default_matmul_precision("bfloat16")
def mha_reference(
    q,
    k,
    v,
    ab,
    segment_ids: SegmentIds | None = None,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale=1.0,
):
    """Attention in plain ``jnp``, differentiated by ``mha_reference_bwd``."""
    return _reference(q, k, v, ab, segment_ids, causal, mask_value, sm_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _reference(q, k, v, ab, segment_ids, causal, mask_value, sm_scale):
    return mha_reference_no_custom_vjp(
        q, k, v, ab, segment_ids, causal=causal, mask_value=mask_value, sm_scale=sm_scale
    )


def _reference_fwd(q, k, v, ab, segment_ids, causal, mask_value, sm_scale):
    kw = dict(causal=causal, mask_value=mask_value, sm_scale=sm_scale)
    out, sums, maxes = mha_reference_no_custom_vjp(q, k, v, ab, segment_ids, save_residuals=True, **kw)
    return out, (q, k, v, ab, segment_ids, out, sums, maxes)


def _reference_bwd(causal, mask_value, sm_scale, saved, d_out):
    kw = dict(causal=causal, mask_value=mask_value, sm_scale=sm_scale)
    *grads, dab = mha_reference_bwd(*saved, d_out, **kw)
    return (*grads, dab, None)  # nothing for the segment ids


_reference.defvjp(_reference_fwd, _reference_bwd)


@functools.partial(jax.jit, static_argnames=["causal", "mask_value", "sm_scale"])
def mha_reference_bwd(
    q,
    k,
    v,
    ab,
    segment_ids: SegmentIds | None,
    o,
    l,
    m,
    do,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale: float = 1.0,
):
    """``(dq, dk, dv, dab)`` of attention from the forward's output ``o``, row sums ``l`` and
    row maxima ``m`` (``dab`` None without ``ab``), in float32 ``jnp``."""
    f32 = [x.astype(F32) for x in (q, k, v, o, do)]
    q32, k32, v32, o32, do32 = f32
    logits = _reference_logits(q32, k32, ab, segment_ids, causal, mask_value, sm_scale)
    probs = jnp.exp(logits - m[..., None]) / l[..., None]
    dv = jnp.einsum("bhij,bhid->bhjd", probs, do32)
    dprobs = jnp.einsum("bhid,bhjd->bhij", do32, v32)
    correction = jnp.sum(o32 * do32, axis=-1, keepdims=True)
    dlogits = probs * (dprobs - correction) * sm_scale
    dq = jnp.einsum("bhij,bhjd->bhid", dlogits, k32)
    dk = jnp.einsum("bhij,bhid->bhjd", dlogits, q32)
    dab = dlogits.astype(ab.dtype) if ab is not None else None
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dab
