"""Plain-``jnp`` splash attention (JAX's ``make_masked_mha_reference`` family): a dense mask,
float32 logits, differentiated by JAX."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


def _reference_api(name: str, custom: bool, doc: str):
    """JAX's ``attention_reference`` (``custom``: ``attention_reference_custom``, with the
    hand-written backward): one signature for both."""

    def reference(
        mask,
        q,
        k,
        v,
        segment_ids,
        sinks=None,
        *,
        mask_value: float = DEFAULT_MASK_VALUE,
        save_residuals: bool = False,
        custom_type: str = "flash",
        attn_logits_soft_cap: float | None = None,
    ):
        args = (mask, q, k, v, segment_ids, sinks, mask_value, save_residuals)
        if custom:
            return _reference_custom(*args, custom_type, attn_logits_soft_cap)
        # every backward here is JAX's autodiff of the same formula: custom_type is not read
        return _one_head(*args, attn_logits_soft_cap)

    reference.__name__ = reference.__qualname__ = name
    reference.__doc__ = doc
    return reference


def _one_head(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, soft_cap):
    """``attention_reference`` of positional arguments."""
    _, logits, mask = _masked_logits(mask, q, k, segment_ids, soft_cap, mask_value)
    top = jnp.max(logits, axis=-1)
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32))
    e = jnp.exp(logits - top[:, None])
    total = jnp.sum(e, axis=-1)
    if sinks is not None:
        total = total + jnp.exp(sinks.astype(jnp.float32) - top)
    out = jnp.einsum("qk,kd->qd", e / total[:, None], v.astype(jnp.float32))
    lse = top + jnp.log(total)
    if sinks is None:
        seen = jnp.any(mask, axis=-1)
        out = jnp.where(seen[:, None], out, 0.0)
        lse = jnp.where(seen, lse, jnp.inf)
    if save_residuals:
        return out, (lse,)
    return out


def _masked_logits(mask, q, k, segment_ids, soft_cap, mask_value):
    """One head's float32 ``(scores q @ k.T, logits, mask)``: the logits soft-capped and set to
    ``mask_value`` where the mask, with the segment ids (also in the returned mask), hides them."""
    raw = jnp.einsum("qd,kd->qk", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = raw if soft_cap is None else soft_cap * jnp.tanh(raw / soft_cap)
    if segment_ids is not None:
        mask = mask & (segment_ids.q[:, None] == segment_ids.kv[None, :])
    return raw, jnp.where(mask, logits, mask_value), mask


def make_attention_reference(mask, is_mqa: bool, backward_impl: str = "vanilla", **params: Any):
    """A reference over all heads for ``mask`` (``[heads, q_len, kv_len]``, a NumPy array or a
    ``MultiHeadMask``): ``f(q, k, v, segment_ids=None, sinks=None, *, mask_value,
    save_residuals, attn_logits_soft_cap)`` with the kernel's argument shapes.
    ``backward_impl`` is accepted for JAX's signature (the gradient is JAX's autodiff)."""
    del backward_impl
    dense = jnp.asarray(np.asarray(mask[:, :, :], dtype=np.bool_))

    @functools.partial(jax.jit, static_argnames=["mask_value", "save_residuals", "attn_logits_soft_cap"])
    def run(
        mask,
        q,
        k,
        v,
        segment_ids=None,
        sinks=None,
        *,
        mask_value: float = DEFAULT_MASK_VALUE,
        save_residuals: bool = False,
        attn_logits_soft_cap: float | None = None,
    ):
        one: Callable[..., Any] = functools.partial(
            attention_reference,
            mask_value=mask_value,
            save_residuals=save_residuals,
            attn_logits_soft_cap=attn_logits_soft_cap,
            **params,
        )
        heads = q.shape[0]
        if is_mqa:
            kk = jnp.broadcast_to(k, (heads, *k.shape))
            vv = jnp.broadcast_to(v, (heads, *v.shape))
        else:
            group = heads // k.shape[0]
            kk, vv = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
        sink_axis = None if sinks is None else 0
        return jax.vmap(one, in_axes=(0, 0, 0, 0, None, sink_axis))(mask, q, kk, vv, segment_ids, sinks)

    return functools.partial(run, dense)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _reference_custom(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, custom_type, soft_cap):
    return _one_head(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, soft_cap)


def _reference_custom_fwd(
    mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, custom_type, soft_cap
):
    if save_residuals:
        raise NotImplementedError("Higher-order AD not supported.")
    out, (lse,) = _one_head(mask, q, k, v, segment_ids, sinks, mask_value, True, soft_cap)
    return out, (mask, q, k, v, segment_ids, sinks, out, lse)


def _reference_custom_bwd(mask_value, save_residuals, custom_type, soft_cap, residuals, d_out):
    """The flash-attention backward from the saved logsumexp: ``p = exp(s - lse)``,
    ``ds = p * (dp - di)`` with ``di = rowsum(o * do)`` (``custom_type="flash"``) or
    ``rowsum(dp * p)`` (otherwise), through the soft cap's ``1 - tanh^2``."""
    del save_residuals
    mask, q, k, v, segment_ids, sinks, out, lse = residuals
    f32 = jnp.float32
    raw, logits, _ = _masked_logits(mask, q, k, segment_ids, soft_cap, mask_value)
    p = jnp.exp(logits - lse[:, None])
    do = d_out.astype(f32)
    dv = jnp.einsum("qk,qd->kd", p, do).astype(v.dtype)
    dp = jnp.einsum("qd,kd->qk", do, v.astype(f32))
    if custom_type == "flash":
        di = jnp.sum(out.astype(f32) * do, axis=-1, keepdims=True)
    else:
        di = jnp.sum(dp * p, axis=-1, keepdims=True)
    ds = (dp - di) * p
    if soft_cap is not None:
        t = jnp.tanh(raw / soft_cap)
        ds = ds * (1 - t * t)
    dk = jnp.einsum("qk,qd->kd", ds, q.astype(f32)).astype(k.dtype)
    dq = jnp.einsum("qk,kd->qd", ds, k.astype(f32)).astype(q.dtype)
    d_sinks = None
    if sinks is not None:  # d lse / d sink = exp(sink - lse); d out = -exp(sink - lse) * out
        weight = jnp.exp(sinks.astype(f32) - lse)
        d_sinks = -jnp.sum(weight * jnp.sum(out.astype(f32) * do, axis=-1)).astype(sinks.dtype)
    return None, dq, dk, dv, None, d_sinks


_reference_custom.defvjp(_reference_custom_fwd, _reference_custom_bwd)


attention_reference = _reference_api(
    "attention_reference",
    custom=False,
    doc="""One head: ``mask [q_len, kv_len]``, ``q [q_len, d]``, ``k``, ``v [kv_len, d]``; returns
    the attention in float32 (with ``save_residuals`` also ``(logsumexp,)``). A query row that
    sees no key (and has no sink) gives zeros and a logsumexp of +inf, as the kernels do
    (JAX's reference: the mean of ``v``).""",
)

attention_reference_custom = _reference_api(
    "attention_reference_custom",
    custom=True,
    doc="""``attention_reference`` with JAX's hand-written backward (``jax.custom_vjp``): the
    gradients are formed as the splash kernels form them, from the forward's logsumexp, with
    ``custom_type`` choosing how ``di`` is summed (``"flash"``: over the head dimension, from
    the output; otherwise over the keys, from the probabilities). Differentiating with
    ``save_residuals=True`` raises NotImplementedError, as JAX's does. Rows that see no key
    give zeros (and zero gradients), as ``attention_reference``.""",
)
